"""A simulated run as a dashboard source: a :class:`~staleflow.sim.cluster.SimCluster`
steps in a background thread, paced so that virtual time runs ``speed`` times faster
than the wall clock (the simulator alone would finish a long run in seconds, before
anyone could watch it).

The cluster is sampled through its ``observers`` hook, once per coordinator cycle, on the
simulator's own thread: each call copies what the dashboard shows into an immutable
frame, so HTTP threads never touch the cluster's mutable state. Rewards are not graded
in the simulator (every trajectory scores 1.0), so records carry no reward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from coordinator.commands import Command
from coordinator.types import InstanceSnapshot, TrajectoryView, TrajRecord
from staleflow.dashboard.interface import (
    ActionNotSupported,
    InstanceDetail,
    LiveView,
    LoadSample,
    Page,
    PSView,
    RunEvent,
    RunInfo,
)
from staleflow.dashboard.timeline import InstanceObservation, Recorder, SeqLog
from staleflow.runfolder.step_record import StepRecord, idle_ratio
from staleflow.sim import PRESETS
from staleflow.sim import system as make_system
from staleflow.sim.cluster import ClusterConfig, SimCluster
from staleflow.sim.engine import InstanceTimes
from staleness.types import ConsumedBatch

logger = logging.getLogger(__name__)

_PS_NOTE = (
    "the simulator models Push and Pull as durations (trainer push_s, engine pull_s) and "
    "holds no weights: versions held, readers and sizes are not modelled"
)


class _Stopped(Exception):
    """Raised from the observer to end the simulation early."""


class SimSource:
    """Build, then :meth:`start`; :meth:`close` stops the simulation thread."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        speed: float = 10.0,
        every_s: float = 0.0,
        frame_s: float = 0.2,
    ):
        if not speed > 0:
            raise ValueError(f"speed={speed}: use virtual seconds per wall second > 0, e.g. 10")
        self.config = config
        self.speed = speed
        self.cluster = SimCluster(config)
        self._cost = self.cluster.coordinator.strategies.cost  # told of speculation
        self._recorder = Recorder(every_s=every_s)
        self._records: SeqLog[StepRecord] = SeqLog()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a new frame was published
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._parked = threading.Event()  # the simulation thread is held by a pause
        self._thread = threading.Thread(target=self._run, name="sim-dashboard", daemon=True)
        self._wall0 = 0.0
        self._failure: str | None = None
        self._cycle_commands: dict[int, Counter[str]] = {}
        self._commands: dict[int, Counter[str]] = {}  # since the start
        self.frame_s = frame_s
        self._next_frame = 0.0
        self._recorded_steps = 0
        # Count each cycle's commands per instance for the instance table: the executor's
        # ``issue`` is its public entry point, wrapped on this one object only (the
        # simulator's files stay untouched).
        executor = self.cluster.executor
        issue = executor.issue

        def counting_issue(commands: list[Command]) -> None:
            for c in commands:
                self._cycle_commands.setdefault(c.inst, Counter())[type(c).__name__.lower()] += 1
            issue(commands)

        executor.issue = counting_issue  # type: ignore[method-assign]
        self.cluster.observers.append(self._observe)
        self._count()
        self._frame = self._capture(finished=False)

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        system: str = "staleflow",
        eta: int | None = None,
        steps: int = 1000,
        seed: int = 0,
        speed: float = 10.0,
    ) -> SimSource:

        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}: use one of {sorted(PRESETS)}")
        kwargs: dict[str, Any] = {"steps": steps, "seed": seed}
        if eta is not None:
            kwargs["eta"] = eta
        return cls(make_system(system, PRESETS[preset](**kwargs)), speed=speed)

    # -- the simulation thread ----------------------------------------------------------

    def start(self) -> SimSource:
        self._wall0 = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.cluster.run()
        except _Stopped:
            pass
        except Exception as exc:  # shown on the page rather than killing the server
            logger.exception("simulation failed")
            self._failure = f"simulation failed: {exc!r}"
        self._count()
        self._publish(finished=True)

    def _observe(self, cluster: SimCluster) -> None:
        self._count()
        # Copying every trajectory of a paper-scale cluster each cycle would cost more
        # than the simulation: frames are refreshed at most every frame_s of wall time.
        if time.monotonic() >= self._next_frame:
            self._publish(finished=False)
        self._cycle_commands = {}
        self._pace(cluster.now)

    def _pace(self, now: float) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped
            if not self._running.is_set():
                self._park()
                continue
            left = self._wall0 + now / self.speed - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, 0.1))  # close() ends the wait at once

    def _park(self) -> None:
        """Paused: publish the state the page keeps showing, then hold the simulation
        until resume (or close, which sets ``_running`` too)."""
        paused_at = time.monotonic()
        self._publish(finished=False)
        self._parked.set()
        self._running.wait()
        self._parked.clear()
        self._wall0 += time.monotonic() - paused_at  # pausing does not bank time

    def _count(self) -> None:
        """Every cycle: load samples, markers and step records (counts only, cheap)."""
        c = self.cluster
        for i, counts in self._cycle_commands.items():
            self._commands.setdefault(i, Counter()).update(counts)
        self._recorder.observe(
            c.now,
            [
                InstanceObservation(
                    i,
                    inst.version,
                    len(inst.running),
                    len(inst.waiting),
                    int(inst.kv),
                    inst.times.tokens,
                )
                for i, inst in c.instances.items()
            ],
            ps_version=c.trainer.ps_version,
            steps=c.trainer.steps,
        )
        self._record_steps()

    def _publish(self, *, finished: bool) -> None:
        frame = self._capture(finished=finished)
        with self._changed:
            self._frame = frame
            self._changed.notify_all()
        self._next_frame = time.monotonic() + self.frame_s

    def _capture(self, *, finished: bool) -> LiveView:
        c = self.cluster
        details = []
        for i, inst in c.instances.items():
            snap = inst.snapshot()
            # SimTrajectory reads its length from the live instance: freeze it.
            snap = InstanceSnapshot(
                inst=snap.inst,
                kv_cache=snap.kv_cache,
                run_trajs=tuple(_frozen(t) for t in snap.run_trajs),
                wait_trajs=tuple(_frozen(t) for t in snap.wait_trajs),
                complete_trajs=tuple(snap.complete_trajs),
                inst_version=snap.inst_version,
            )
            details.append((i, snap, _idle_ratio(inst.times)))
        notes = [self._failure] if self._failure else []
        pending = c.executor.pending_by_instance()
        if c.stalled:
            notes.append("the simulation stalled: no training step for stall_timeout_s")
        return LiveView(
            buffers=c.manager.view(),
            instances=tuple(
                InstanceDetail(
                    inst=i,
                    version=snap.inst_version,
                    snapshot=snap,
                    measured_tokens_per_s=self._recorder.rates.get(i),
                    idle_ratio=idle,
                    pending_commands=pending.get(i, 0),
                    last_cycle_commands=dict(self._cycle_commands.get(i, {})),
                    commands_total=dict(self._commands.get(i, {})),
                )
                for i, snap, idle in details
            ),
            ts=c.ts.stats(),
            ps_version=c.trainer.ps_version,
            steps=c.trainer.steps,
            elapsed_s=c.now,
            finished=finished,
            cycles=c.coordinator.stats.cycles,
            discarded=c.coordinator.stats.discarded,
            pending_commands=c.executor.pending,
            notes=tuple(notes),
        )

    def _record_steps(self) -> None:
        c = self.cluster
        tr = c.trainer
        while self._recorded_steps < tr.steps:
            k = self._recorded_steps
            self._records.append(self._step_record(k))
            self._recorded_steps += 1

    def _step_record(self, k: int) -> StepRecord:
        """Step ``k + 1``'s record (no reward fields: the simulator grades none)."""
        c, tr = self.cluster, self.cluster.trainer
        end = tr.step_ends[k]
        wall = end - (tr.step_ends[k - 1] if k else 0.0)
        tokens = tr.step_tokens[k]
        batch = c.batches[k]
        busy = min(tr.costs.step_seconds(tokens), wall)
        idle = {i: _idle_ratio(inst.times) for i, inst in c.instances.items()}
        return StepRecord(
            step=k + 1,
            version=batch.version,
            elapsed_s=end,
            step_s=wall,
            tokens_per_s=sum(tr.step_tokens[: k + 1]) / max(end, 1e-9),
            step_tokens_per_s=tokens / max(wall, 1e-9),
            tokens=int(tokens),
            trajectories=sum(len(g.trajectories) for g in batch.groups),
            trainer_idle_ratio=idle_ratio(wall - busy, busy),
            ps_version=tr.ps_version,
            cycles=c.coordinator.stats.cycles,
            discarded=c.coordinator.stats.discarded,
            staleness=_trajectory_staleness(batch),
            instance_idle={i: r for i, r in idle.items() if r is not None},
            instance_version={i: inst.version for i, inst in c.instances.items()},
        )

    # -- RunSource ------------------------------------------------------------------------

    def info(self) -> RunInfo:
        cfg = self.config
        return RunInfo(
            kind="sim",
            name=f"sim:{cfg.name}",
            clock="virtual",
            eta=cfg.eta,
            batch_size=cfg.batch_size,
            group_size=cfg.group_size,
            instances=cfg.instances,
            cost_model=self._cost,
            config={
                "instances": cfg.instances,
                "eta": cfg.eta,
                "batch_size": cfg.batch_size,
                "group_size": cfg.group_size,
                "steps": cfg.steps,
                "seed": cfg.seed,
                "system": cfg.name,
                "routing": cfg.coordinator.routing,
                "synchronization": cfg.coordinator.synchronization,
                "migration": cfg.coordinator.migration,
                "speed": self.speed,
            },
            actions=("pause", "resume"),
            notes=("simulated: times are virtual seconds; rewards are not graded",),
        )

    def live(self) -> LiveView:
        with self._lock:
            return self._frame

    def records(self, since: int, limit: int) -> Page[StepRecord]:
        return self._records.page(since, limit)

    def load(self, since: int, limit: int) -> Page[LoadSample]:
        return self._recorder.load.page(since, limit)

    def events(self, since: int, limit: int) -> Page[RunEvent]:
        return self._recorder.events.page(since, limit)

    def ps(self) -> PSView:
        frame = self.live()
        tr = self.cluster.trainer
        return PSView(
            latest=frame.ps_version,
            held=None,
            num_slots=None,
            readers=None,
            pushing=tr.push_until > frame.elapsed_s,
            last_push_s=self._recorder.last_push,
            last_pull_s=dict(self._recorder.last_pull),
            version_bytes=None,
            notes=(_PS_NOTE,),
        )

    def act(self, action: str) -> str:
        if action == "pause":
            self._running.clear()
            return "paused"
        if action == "resume":
            self._running.set()
            return "resumed"
        raise ActionNotSupported(f"unknown action {action!r}: use pause or resume")

    @property
    def paused(self) -> bool:
        """A pause was asked for (see :meth:`wait_paused` for when it took hold)."""
        return not self._running.is_set()

    def wait_paused(self, timeout: float | None = None) -> bool:
        """Block until the simulation is held by a pause, its state published; False on
        timeout."""
        return self._parked.wait(timeout)

    def wait(self, predicate: Callable[[LiveView], bool], timeout: float | None = None) -> bool:
        """Block until a published state satisfies ``predicate`` (checked at once, then at
        every new state); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self._frame), timeout)

    def close(self) -> None:
        self._stop.set()
        self._running.set()
        if self._thread.is_alive():
            self._thread.join(5.0)


def _trajectory_staleness(batch: ConsumedBatch) -> dict[int, int]:
    """``V_buf - V -> trajectories``, each member counted at its group's V (the minimum
    of its members' V_traj, all the simulator keeps once a group is consumed)."""
    hist: Counter[int] = Counter()
    for g in batch.groups:
        hist[g.staleness(batch.version)] += len(g.trajectories)
    return dict(sorted(hist.items()))


def _idle_ratio(t: InstanceTimes) -> float | None:
    return idle_ratio(t.idle, t.decode + t.prefill + t.pull)


def _frozen(t: TrajectoryView) -> TrajRecord:
    return TrajRecord(t.traj_id, t.group_id, t.v_traj, t.length, t.prompt_len)
