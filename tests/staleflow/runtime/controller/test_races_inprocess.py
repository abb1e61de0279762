"""SpecActor's tail race in the real runtime (``staleflow/runtime/controller/races.py``), wired in one
process with threads: the real control plane, TS, staleness manager, coordinator, instance
hosts, reward stage and training loop, with the fake engine, trainer, PS and reward
function of ``fakes.py``. No Ray.

The scene is the one the race is for: synchronous RL (eta = 0), where the trainer waits for
the last trajectories of its buffer while instances that finished theirs sit idle at the
same version. Instance 0 decodes slowly (a sleep per step), instance 1 at full speed; the
fake engine's tokens depend on the trajectory only, as seeded sampling's do, so a copy
produces exactly the original's tokens.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from coordinator import CoordinatorConfig
from coordinator.config import RaceConfig
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.in_process import Serialized
from staleflow.runtime.workers.instance_host import InstanceHost
from staleflow.runtime.workers.reward_stage import RewardStage
from staleflow.runtime.workers.training_loop import TrainingLoop
from staleness import StalenessConfig
from tests.staleflow.recovery.runs import Prompts
from tests.staleflow.runtime.fakes import (
    EOS,
    CountingTrainer,
    MemoryPS,
    ScriptedEngine,
    SyncPusher,
    parity_scorer,
)
from trajectory_server import TrajectoryServer, TrajectoryServerConfig

BATCH, GROUP, TARGET, SPREAD = 2, 2, 12, 4


class Slow(ScriptedEngine):
    """The fake engine, sleeping ``delay_s`` before every step (a slow instance)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(target=TARGET, max_running=4, spread=SPREAD)
        self.delay_s = delay_s

    def step(self):
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().step()


class ResumeSeeded(Slow):
    """Draws keyed by a request's resume point, as vLLM's per-request seed is: it records
    every (trajectory, resume point) it was given."""

    samples_by_resume_point = True

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        self.submitted: list[tuple[int, int]] = []

    def submit(self, requests):
        self.submitted += [(r.traj_id, len(r.tokens)) for r in requests]
        super().submit(requests)


class Wired:
    def __init__(
        self,
        *,
        race: bool,
        delay_s: float = 0.05,
        fast_s: float = 0.0,
        engine: type[Slow] = Slow,
        progress_every_s: float = 0.0,
    ) -> None:
        self.progress_every_s = progress_every_s
        self.ts = Serialized(TrajectoryServer(TrajectoryServerConfig(0, BATCH, GROUP), Prompts()))
        self.ps = MemoryPS()
        box: list[ControlPlane] = []
        stage = RewardStage(
            parity_scorer, lambda t: "a" * len(t), self.ts, lambda r: box[0].rewarded(r)
        )
        lock = threading.Lock()

        def finished(items):  # in the instance's own name: a loser's completion is late
            with lock:
                for f in items:
                    stage.process([f], instance_id=f"{f.instance}.0")

        def copies_finished(pairs):  # each in its holder's name
            with lock:
                return [t for f, h in pairs for t in stage.process([f], instance_id=h)]

        self.engines = {0: engine(delay_s), 1: engine(fast_s)}
        self.hosts = {
            i: InstanceHost(
                i,
                e,
                ts=self.ts,
                weights=self.ps,
                max_response=64,
                on_finished=finished,
                holder=f"{i}.0",
                on_copy_finished=copies_finished,
            )
            for i, e in self.engines.items()
        }
        self.pool = ThreadPoolExecutor(4)
        self.control = ControlPlane(
            ControlConfig(
                StalenessConfig(eta=0, batch_size=BATCH, group_size=GROUP),
                # least-loaded routing and no migration: nothing but the race moves work
                # off the slow instance
                CoordinatorConfig(
                    period_s=0.005,
                    routing="vanilla",
                    migration="vanilla",
                    race=RaceConfig(enabled=race),
                ),
                idle_wait_s=0.002,
            ),
            ts=self.ts,
            instances=self.hosts,
            holders={i: h.holder for i, h in self.hosts.items()},
            versions=dict.fromkeys(self.hosts, 0),
            ps_version=self.ps.latest,
            run_round=lambda actions: list(self.pool.map(lambda a: a(), actions)),
        )
        box.append(self.control)
        self.trainer = CountingTrainer()
        self.loop = TrainingLoop(
            self.trainer, control=self.control, ts=self.ts, pusher=SyncPusher(self.ps)
        )

    def run(self, steps: int, stop_when=None) -> list:
        for h in self.hosts.values():
            h.start(0, self.progress_every_s)
        self.control.start()
        out: dict = {}

        def train() -> None:
            try:
                out["reports"] = self.loop.run(steps)
            except BaseException as exc:
                out["error"] = exc

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        if stop_when is not None:
            deadline = time.monotonic() + 60
            while not stop_when() and time.monotonic() < deadline:
                time.sleep(0.002)
            assert stop_when(), "the awaited state never came"
            self.control.request_stop()
        thread.join(120)
        assert not thread.is_alive(), "the trainer did not finish"
        self.control.stop()
        for h in self.hosts.values():
            h.stop()
        self.pool.shutdown()
        if "error" in out:
            raise out["error"]
        return out["reports"]


def expected_tokens(tid: int) -> list[int]:
    return [7] * (TARGET + tid % SPREAD - 1) + [EOS]


def test_copies_of_the_slow_instances_stragglers_win_and_change_no_token():
    w = Wired(race=True)
    reports = w.run(4)
    assert len(reports) == 4
    races = w.control.races
    assert races is not None
    c = races.counters()
    assert c.started >= 1 and c.won >= 1, c
    seen = set()
    for r, batch in zip(reports, w.trainer.batches, strict=True):
        for g in batch.groups:
            for t in g.trajectories:
                assert t.traj_id not in seen, "a trajectory was trained twice"
                seen.add(t.traj_id)
                assert r.version - t.v_traj == 0  # eta = 0: on-policy, race or not
                # the copy's tokens are the original's: the kept response is the same
                # whichever side finished first
                assert t.tokens.tolist() == expected_tokens(t.traj_id)
    assert len(seen) == 4 * BATCH * GROUP
    stats = w.ts.stats()
    live = len(w.ts.ledger())
    assert stats.created_trajectories == (
        stats.consumed_trajectories + stats.aborted_trajectories + live
    )
    # the records carry the counters; nothing is left racing or copied once the run ends
    last = w.control.records()[-1].extra
    assert 1 <= last["race/won"] <= c.won and last["race/started"] <= c.started
    assert all(not h.copies() for h in w.hosts.values())


def test_without_the_race_the_slow_instance_keeps_its_trajectories():
    w = Wired(race=False, delay_s=0.005)
    reports = w.run(2)
    assert w.control.races is None
    assert "race/started" not in w.control.records()[-1].extra
    for batch in w.trainer.batches:
        for g in batch.groups:
            for t in g.trajectories:
                assert t.tokens.tolist() == expected_tokens(t.traj_id)
    assert len(reports) == 2


def test_a_stop_drops_every_copy_and_keeps_the_holders_partials_whole():
    # the holder is far behind, and the copy takes long enough to be caught running
    w = Wired(race=True, delay_s=0.2, fast_s=0.01)
    races = w.control.races
    assert races is not None
    # a copy is running: the stop comes then, so more steps only give a loaded machine more
    # chances to catch one (a copy can win within a tenth of a second)
    w.run(20, stop_when=lambda: bool(races.active))
    assert all(not h.copies() for h in w.hosts.values())
    cut = w.control.pending_cut()
    assert cut is not None and cut.final
    # the TS got every trajectory back from its holder (none is left ROUTED)
    assert "routed" not in set(cut.trajectories["trajectories"]["state"])


def test_the_end_of_a_run_drops_the_copies_still_racing():
    """A run that ends (no stop asked) with a copy running: no cycle will end that race, so
    the plane's stop drops it rather than leave it decoding on an instance."""
    w = Wired(race=True, delay_s=0.2, fast_s=0.01)
    races = w.control.races
    assert races is not None
    for h in w.hosts.values():
        h.start(0, 0.0)
    w.control.start()
    deadline = time.monotonic() + 60
    while not races.active and time.monotonic() < deadline:
        time.sleep(0.002)
    assert races.active, "no race started"
    w.control.stop()
    try:
        assert not races.active
        assert all(not h.copies() for h in w.hosts.values())
    finally:
        for h in w.hosts.values():
            h.stop()
        w.pool.shutdown()


def test_with_draws_keyed_by_the_resume_point_a_copy_forks_where_its_original_resumed():
    """vLLM seeds a request by (run seed, trajectory, resume point): a copy samples its
    original's tokens only if both resumed at the same point. The holder reports progress
    as it goes, so the TS's response (where a copy forks) is ahead of where the original
    was submitted; the race therefore first resubmits the original where it is
    (``prepare_race``), and every copy forks at a point its original resumed from."""
    w = Wired(race=True, engine=ResumeSeeded, progress_every_s=0.01)
    forks: list[tuple[int, int]] = []
    for host in w.hosts.values():
        race = host.race

        def recorded(tid, holder, draft_method=None, race=race):
            n = race(tid, holder, draft_method)
            if n is not None:
                forks.append((tid, n))
            return n

        host.race = recorded  # type: ignore[method-assign]
    reports = w.run(4)
    assert len(reports) == 4
    assert forks, "no race started"
    resumed = {s for e in w.engines.values() for s in e.submitted}
    for tid, n in forks:
        assert (tid, n) in resumed, (tid, n)
        # the original resubmitted at n on its holder, and the copy at n elsewhere
        assert sum(1 for e in w.engines.values() if (tid, n) in e.submitted) == 2
    assert all(not h.copies() for h in w.hosts.values())


def _routed(tid: int, tokens: int = 0):
    import numpy as np

    from trajectory_server.types import RoutedTrajectory

    ids = np.full(tokens, 7, np.int32)
    return RoutedTrajectory(
        tid, 0, 0, 0, "", np.arange(3, dtype=np.int32), ids, ids.astype(np.float32), ids * 0
    )


def test_a_copy_is_in_the_batch_but_no_trajectory_of_its_instance():
    """RolloutInstance's bookkeeping, driven by hand (no generation thread): a copy counts
    in the KV, not in the snapshot's lists, held() or progress(); it finishes through
    on_copy_finished (never on_finished nor Eq. 1's completed list); a Pull drops it; the
    holder's settle_won lists a trajectory as completed."""
    from staleflow.rollout.instance import RolloutInstance

    finished, copies = [], []

    def copy_done(pairs):
        copies.extend(pairs)
        return [f.task.traj_id for f, _ in pairs]  # the TS took it: the copy won

    inst = RolloutInstance(
        1,
        ScriptedEngine(target=3),
        max_response=16,
        on_finished=finished.extend,
        on_copy_finished=copy_done,
    )
    inst.submit([_routed(10)])
    inst.submit_copy(_routed(20, tokens=1), holder="0.0")
    inst._engine.step()  # both enter the batch
    snap = inst.snapshot()
    assert [t.traj_id for t in snap.run_trajs] == [10] and snap.wait_trajs == ()
    assert snap.kv_cache == (3 + 1) + (3 + 2)  # the copy's KV counts
    assert inst.held() == {10} and set(inst.progress()) == {10}
    assert inst.copies() == {20: "0.0"}
    inst.start()
    deadline = time.monotonic() + 30
    while not (copies and finished) and time.monotonic() < deadline:
        time.sleep(0.005)
    inst.stop()
    assert [(f.task.traj_id, h) for f, h in copies] == [(20, "0.0")]
    assert [f.task.traj_id for f in finished] == [10]
    assert inst.snapshot().complete_trajs == (10,)  # the copy is its holder's completion
    ended = inst.drop_copies([20])
    assert ended[20].won and ended[20].tokens == len(copies[0][0].task.tokens)
    # a Pull drops the copies still running, and they end as lost
    other = RolloutInstance(
        2,
        ScriptedEngine(target=50),
        max_response=64,
        on_finished=finished.extend,
        on_copy_finished=copy_done,
    )
    other.submit_copy(_routed(30, tokens=2), holder="0.0")
    other._engine.step()
    other.load_weights({}, 1)
    assert other.copies() == {} and other.snapshot().kv_cache == 0
    assert other.drop_copies([30])[30].won is False
    # the holder whose trajectory a copy completed: stopped, listed as completed
    holder = RolloutInstance(
        0,
        ScriptedEngine(target=50),
        max_response=64,
        on_finished=finished.extend,
        on_copy_finished=copy_done,
    )
    holder.submit([_routed(30, tokens=2)])
    holder._engine.step()
    assert holder.settle_won([30]) == {30: 3}
    assert holder.held() == set() and holder.snapshot().complete_trajs == (30,)
    assert holder.settle_won([30]) == {}
