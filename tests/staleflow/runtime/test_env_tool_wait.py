"""A Pull issued while every trajectory waits on a tool completes without waiting for the
tool (issue 34): the runtime wired in one process with threads (the real TS, staleness
manager, coordinator, control plane, instance hosts and environment stage; the engine
and PS are the runtime tests' fakes, ``fakes.py``).

The environment, defined here, calls a tool on every turn that sleeps an hour: the stage
really waits (on an event the test sets only at its end), so a Pull that waited for it
would not come within the test's patience. The coordinator synchronises with ``drain``:
it Pulls only once no instance runs or queues anything, so the Pull also shows that a
trajectory inside its tool call is on no instance and holds no decode slot.

The same run shows the coordinator's rules for multi-turn work fed from the real control
plane (``ControlConfig.tool_waits``, runtime/controller/tool_view.py): the snapshots it
decides on list each waiting trajectory on the instance its turn ended on, and its
learned tool waits count them as waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from coordinator import CoordinatorConfig
from staleflow.control.late import hand_live
from staleflow.envs import EnvSample, EnvState, Episode, EpisodeLimits, ModelTurn, Step
from staleflow.envs.formats import PlainFormat, episode_dataset, tool_tokenizer
from staleflow.rollout.instance import Finished
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.in_process import Serialized
from staleflow.runtime.interface import Rewarded
from staleflow.runtime.workers.env_stage import EnvironmentStage
from staleflow.runtime.workers.instance_host import InstanceHost
from staleflow.runtime.workers.reward_stage import RewardStage
from staleness import StalenessConfig
from tests.staleflow.runtime.fakes import MemoryPS, PrefixKeepingEngine, ScriptedEngine
from trajectory_server import FinishedTrajectory, TrajectoryServer, TrajectoryServerConfig

HOUR_S = 3600.0
PATIENCE_S = 60.0  # a liveness bound on a loaded machine; the tool would take an hour
ETA, BATCH, GROUP = 1, 2, 2
IN_FLIGHT = (ETA + 1) * BATCH * GROUP  # every trajectory the TS holds at version 0
TOK = tool_tokenizer("lookup")


class SlowToolEnv:
    """Every model turn calls a tool that takes an hour; the answer is always 'ok'."""

    name = "slow_tool"

    def start(self, sample: EnvSample, seed: int) -> Episode:
        return Episode(({"role": "user", "content": sample.prompt},), (), {"calls": 0})

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        calls = int(state["calls"]) + 1  # type: ignore[arg-type]
        info = {"tool_calls": 1, "tool_latency_s": HOUR_S}
        return Step({"calls": calls}, observation="ok", latency_s=HOUR_S, info=info)

    def score(self, state: EnvState) -> float:
        return 0.0


class _Source:
    def __init__(self) -> None:
        samples = [EnvSample(i, f"look up item {i}", "ok") for i in range(64)]
        self._left = list(episode_dataset(SlowToolEnv(), samples, PlainFormat(TOK)))

    def next_sample(self):
        return self._left.pop(0) if self._left else None


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not cond():
        assert time.monotonic() < deadline, f"not within {PATIENCE_S:g} s: {what}"
        time.sleep(0.01)


class _Runtime:
    """The runtime in one process: the real TS, environment stage, instance hosts over
    fake engines, and control plane; ``report`` sees the rewarded records first."""

    def __init__(
        self,
        sleep: Callable[[float], None],
        threads: int,
        coordinator: CoordinatorConfig,
        prefix_cache: bool = False,
        keeps_prefixes: bool = False,
        report: Callable[[list[Rewarded]], None] = lambda records: None,
    ) -> None:
        self.ts = ts = Serialized(
            TrajectoryServer(TrajectoryServerConfig(ETA, BATCH, GROUP), _Source())
        )

        def rewarded(records: list[Rewarded]) -> None:
            report(records)
            self.control.rewarded(records)

        rewards = RewardStage(lambda items: [], TOK.decode, ts, rewarded, "w")
        self.stage = stage = EnvironmentStage(
            SlowToolEnv(),
            PlainFormat(TOK),
            EpisodeLimits(max_turns=2, max_tokens=64),
            ts,
            rewards,
            worker_id="w",
            threads=threads,
            sleep=sleep,
        )
        # as many calls at once as the stage has threads, as a reward actor takes
        # (max_concurrency=env.threads, driver/pools/rewards.py): with fewer, calls whose
        # tools sleep hold every worker thread and a later turn never reaches its tool
        self.worker = worker = ThreadPoolExecutor(threads, thread_name_prefix="reward-worker")

        def dispatch(finished: list[Finished], holder: int) -> None:
            """What a rollout actor does with finished turns (RolloutActor._dispatch):
            hand them to a worker in the TS, then send them to it without waiting (Ray's
            ``.remote``)."""
            items = [
                FinishedTrajectory(
                    t.traj_id, t.tokens, t.logprobs, t.versions, t.finish_reason, t.mask
                )
                for t in (f.task for f in finished)
            ]
            kept = set(hand_live(ts, items, "w", instance_id=holder))
            worker.submit(stage.process, [f for f in finished if f.task.traj_id in kept])

        self.ps = MemoryPS()
        engine = PrefixKeepingEngine if keeps_prefixes else ScriptedEngine
        self.engines = {i: engine(target=4, max_running=4) for i in range(2)}
        self.hosts = {
            i: InstanceHost(
                i,
                self.engines[i],
                ts=ts,
                weights=self.ps,
                max_response=64,
                on_finished=lambda fs, i=i: dispatch(fs, i),
            )
            for i in range(2)
        }
        self.rounds = rounds = ThreadPoolExecutor(4)
        self.control = ControlPlane(
            ControlConfig(
                StalenessConfig(eta=ETA, batch_size=BATCH, group_size=GROUP),
                coordinator,
                idle_wait_s=0.002,
                tool_waits=True,
                prefix_cache=prefix_cache,
            ),
            ts=ts,
            instances=self.hosts,
            ps_version=self.ps.latest,
            run_round=lambda actions: list(rounds.map(lambda a: a(), actions)),
        )

    def start(self) -> None:
        for h in self.hosts.values():
            h.start()
        self.control.start()

    def close(self) -> None:
        self.control.stop()
        for h in self.hosts.values():
            h.stop()
        self.worker.shutdown(wait=True)
        self.stage.close()
        self.rounds.shutdown(wait=True)


def test_a_pull_while_every_trajectory_waits_on_its_tool_does_not_wait_for_the_tool() -> None:
    released = threading.Event()  # the tool's hour ends when the test says so
    tool_sleeps: list[float] = []

    def tool_sleep(seconds: float) -> None:
        tool_sleeps.append(seconds)
        released.wait(seconds)

    rt = _Runtime(tool_sleep, IN_FLIGHT, CoordinatorConfig(period_s=0.005, synchronization="drain"))
    ts, control, engines, ps, stage = rt.ts, rt.control, rt.engines, rt.ps, rt.stage
    rt.start()
    try:
        # every trajectory of version 0 took its first turn and sits in its tool call:
        # in the TS with its worker, on no instance
        _until(
            lambda: ts.stats().rewarding == IN_FLIGHT and len(tool_sleeps) == IN_FLIGHT,
            f"{IN_FLIGHT} trajectories in their tool calls",
        )
        assert all(not h.held() for h in rt.hosts.values())
        # the coordinator sees them, each on the instance its turn ended on
        _until(
            lambda: sum(len(s.env_trajs) for s in control.loop.last_snapshot) == IN_FLIGHT,
            "every waiting trajectory in the coordinator's snapshot",
        )
        turned = {t.traj_id: s.inst for s in control.loop.last_snapshot for t in s.env_trajs}
        assert turned == {r.traj_id: i for r, i in ts.tool_waits()}
        assert all(not s.held for s in control.loop.last_snapshot)  # no prefix cache here
        waits = control.coordinator.strategies.waits
        assert waits is not None
        _until(lambda: all(waits.waited(t) > 0.0 for t in turned), "their waits measured")
        assert [e.loads for e in engines.values()] == [[0], [0]]
        ps.push({"w": np.ones(2, np.float32)}, version=1)  # the trainer's Push of version 1
        # the coordinator Pulls every instance to version 1, the tools still asleep
        _until(lambda: all(e.loads[-1] == 1 for e in engines.values()), "the Pull of version 1")
        control.check()
        assert not released.is_set() and stage.steps == 0  # no tool has answered
        assert ts.stats().rewarding == IN_FLIGHT
    finally:
        released.set()
        rt.close()
    # the tools' answers still reached the TS, once they came: every trajectory took
    # its observation and a next turn (or ended), none was lost in the Pull
    stats = ts.stats()
    assert stage.steps >= IN_FLIGHT
    assert stats.created_trajectories == (
        stats.consumed_trajectories + stats.aborted_trajectories + stats.queued
        + stats.routed + stats.completed
    )  # fmt: skip


def test_an_ended_episode_has_its_prefix_dropped_wherever_its_engine_keeps_it() -> None:
    """The same runtime with a tool that answers in 0.2 s, episodes of two turns and
    engines that keep each stopped turn's prefix and list it (``PrefixKeepingEngine``,
    as the embedded engine's store): the coordinator's snapshots list the engines' own
    prefixes while their trajectories wait; every episode that ends reaches the control
    plane's records, which asks the instance of its last turn (and one an earlier turn
    left a copy on) to drop it, so that in the end no engine keeps an ended episode's
    prefix and no snapshot lists one."""
    ended: dict[int, int] = {}  # trajectory -> instance of its last turn (the records')
    rt = _Runtime(
        lambda seconds: time.sleep(0.2),  # long enough for cycles to see it wait
        threads=2,
        coordinator=CoordinatorConfig(period_s=0.005),
        prefix_cache=True,
        keeps_prefixes=True,
        report=lambda records: ended.update((r.traj_id, r.instance) for r in records),
    )
    control = rt.control
    dropped: dict[int, set[int]] = {}  # trajectory -> instances asked to drop its prefix
    lock = threading.Lock()
    for i, host in rt.hosts.items():
        keep = host.drop_prefixes

        def spy(traj_ids, i=i, keep=keep):
            with lock:
                for t in traj_ids:
                    dropped.setdefault(t, set()).add(i)
            return keep(traj_ids)

        host.drop_prefixes = spy  # type: ignore[method-assign]
    rt.start()
    try:
        # every trajectory the window admits at version 0 plays its two turns and ends
        seen: set[int] = set()  # listed as held while it waited

        def all_ended() -> bool:
            snaps = control.loop.last_snapshot
            assert all(s.held_exact for s in snaps)  # the engines' own lists
            seen.update(t for s in snaps for t, _ in s.held)
            return len(ended) == IN_FLIGHT

        _until(all_ended, f"{IN_FLIGHT} episodes ended")
        _until(lambda: set(dropped) >= set(ended), "every ended episode's prefix dropped")
        control.check()
        snapshot = control.loop.last_snapshot
        _until(lambda: control.loop.last_snapshot is not snapshot, "a cycle after the ends")
        held = {t for s in control.loop.last_snapshot for t, _ in s.held}
    finally:
        rt.close()
    assert all(ended[t] in dropped[t] for t in ended)  # on the instance of its last turn
    assert seen & set(ended), "no snapshot listed a prefix while its trajectory waited"
    assert not held & set(ended)
    kept = {t for e in rt.engines.values() for t in e.held_prefixes()}  # type: ignore[attr-defined]
    assert not kept & set(ended), "an engine still keeps an ended episode's prefix"
