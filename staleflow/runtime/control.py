"""The control plane: the staleness manager and the coordinator, on one loop thread.

Everything that decides lives here and runs on a single thread, so the manager and the
coordinator never see concurrent calls from this side: other components (reward workers,
the trainer) only post messages to the inbox, and the loop applies them in order. One
iteration reads like §5.2 / Figure 9:

1. apply what arrived: rewarded trajectories are Occupied (``complete``); trajectories
   the TS dropped are aborted on their instances;
2. hand the trainer its buffer when it is Ready (Consume);
3. run the coordinator's snapshot-command cycle when it is due, and carry the commands
   out (Pulls and Routes of different instances concurrently, via ``run_round``).

A failure on the loop stops the plane and is re-raised to every caller, so a dead
instance surfaces as an error in the trainer and the launcher rather than a hang.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator import Coordinator, CoordinatorConfig, InProcessExecutor, Snapshot
from coordinator.types import InstanceSnapshot
from staleflow.runtime.interface import InstanceHandle, Rewarded, StepReport
from staleflow.runtime.metrics import StepMetrics
from staleflow.runtime.planes import RuntimePlanes
from staleflow.runtime.record import StepRecord
from staleness import ConsumedBatch, StalenessConfig, StalenessManager
from staleness.types import ManagerView
from trajectory_server.errors import TrajectoryServerError
from trajectory_server.types import AbortedTrajectory, RoutableTrajectory, TSStats

logger = logging.getLogger(__name__)


class TrajectoryServerLike(Protocol):
    def routing_view(self) -> Sequence[RoutableTrajectory]: ...

    def abort(self, traj_ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]: ...

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]: ...

    def stats(self) -> TSStats: ...


class ControlPlaneError(RuntimeError):
    """The control loop stopped; the message says why."""


@dataclass(frozen=True, slots=True)
class ControlConfig:
    staleness: StalenessConfig
    coordinator: CoordinatorConfig
    idle_wait_s: float = 0.05  # longest sleep between loop iterations


@dataclass(frozen=True, slots=True)
class LiveState:
    """What a dashboard or progress display shows between steps."""

    buffers: ManagerView
    instances: tuple[InstanceSnapshot, ...]
    ts: TSStats | None
    ps_version: int
    steps: int
    rewarded: int
    elapsed_s: float
    cycles: int = 0
    discarded: int = 0
    last_discard: str = ""  # why the last snapshot failed Eq. 1
    pending: Mapping[int, int] = field(default_factory=dict)  # commands in flight, by instance
    commands: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # issued, by kind


class ControlPlane:
    def __init__(
        self,
        config: ControlConfig,
        *,
        ts: TrajectoryServerLike,
        instances: Mapping[int, InstanceHandle],
        ps_version: Callable[[], int],
        gather: Callable[[], Sequence[InstanceSnapshot]] | None = None,
        run_round: Callable[[Sequence[Callable[[], None]]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.manager = StalenessManager(config.staleness)
        self._ts = ts
        self._instances = instances
        self._ps_version = ps_version
        self._gather = gather or (lambda: [h.snapshot() for h in instances.values()])
        self._clock = clock
        self._group_of: dict[int, int] = {}
        self.planes = RuntimePlanes(instances, self.manager, self._group_of.get)
        self.executor = InProcessExecutor(
            self.planes, self.planes, self.planes, self.manager, run_round=run_round
        )
        self.coordinator = Coordinator(
            config.coordinator,
            snapshots=self,
            trajectories=self,
            parameters=self,
            admission=self.manager,
            executor=self.executor,
            instances=dict.fromkeys(instances, 0),
            clock=clock,
        )
        self.metrics = StepMetrics(list(instances), clock())
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._consume: tuple[int, Future[ConsumedBatch]] | None = None
        self._last_snapshot: tuple[InstanceSnapshot, ...] = ()
        self._latest_version = 0
        self._last_discard = ""
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._records_lock = threading.Lock()

    # -- entry points (any thread) -----------------------------------------------------

    def rewarded(self, records: Sequence[Rewarded]) -> None:
        self._post("rewarded", tuple(records))

    def dropped(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        self._post("dropped", tuple(trajectories))

    def trained(self, report: StepReport) -> None:
        self._post("trained", report)

    def consume(self, version: int, timeout_s: float | None = None) -> ConsumedBatch:
        future: Future[ConsumedBatch] = Future()
        self._post("consume", (version, future))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
            try:
                return future.result(left)
            except TimeoutError:
                self.check()  # the loop died after we posted: do not wait forever
                if deadline is not None and time.monotonic() >= deadline:
                    if future.cancel():
                        raise TimeoutError(
                            f"buffer {version} was not Ready within {timeout_s:g} s: rollout "
                            "made no batch in that time (see the dashboard's buffers for the "
                            "Stuck one); if rollouts are just slow, raise "
                            "trainer.stall_timeout_s (0 waits forever)"
                        ) from None
                    return future.result()  # being consumed as we gave up: take it

    def records(self, since: int = 0) -> list[StepRecord]:
        """Per-step metric records from index ``since`` on."""
        self.check()
        return self.metrics.records[since:]

    def live(self) -> LiveState:
        self.check()
        return LiveState(
            buffers=self.manager.view(),
            instances=self._last_snapshot,
            ts=None,
            ps_version=self._latest_version,
            steps=len(self.metrics.records),
            rewarded=self.metrics.rewarded_total,
            elapsed_s=self._clock() - self.metrics.started,
            cycles=self.coordinator.stats.cycles,
            discarded=self.coordinator.stats.discarded,
            last_discard=self._last_discard,
            pending=self.executor.pending_by_instance(),
            commands=self.executor.issued,
        )

    def check(self) -> None:
        if self._failure is not None:
            raise ControlPlaneError(f"control plane stopped: {self._failure!r}") from self._failure

    # -- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="control-plane", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._failure is None:
            self._drain_inbox()  # the last step's report may have arrived as we stopped

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self.run_once()
                due = self.coordinator.next_due - self._clock()
                self._wake.wait(min(max(due, 0.0), self.config.idle_wait_s))
                self._wake.clear()
        except BaseException as exc:  # re-raised to every caller
            logger.exception("control plane failed")
            self._failure = exc
            # Nobody may wait forever on a plane that stopped: fail every pending Consume.
            error = ControlPlaneError(f"control plane failed: {exc!r}")
            waiting = [self._consume[1]] if self._consume is not None else []
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "consume":
                    waiting.append(payload[1])
            for future in waiting:
                if not future.done():
                    future.set_exception(error)

    def run_once(self) -> None:
        """One iteration (also what tests drive directly, without the thread)."""
        self._drain_inbox()
        self._serve_consume()
        now = self._clock()
        if now >= self.coordinator.next_due:
            self._latest_version = self._ps_version()
            discarded = self.coordinator.stats.discarded
            self.coordinator.step(now)
            if self.coordinator.stats.discarded > discarded:
                snapshot = Snapshot(self._last_snapshot)
                self._last_discard = str(self.coordinator.speculative.mismatches(snapshot)[:2])
            self.executor.run_until_idle()
            self._serve_consume()

    def _post(self, kind: str, payload: Any) -> None:
        self.check()
        self._inbox.put((kind, payload))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "rewarded":
                self._occupy(payload)
            elif kind == "dropped":
                self._abort_on_instances(t.traj_id for t in payload if t.instance_id is not None)
            elif kind == "trained":
                self._record_step(payload)
            elif kind == "consume":
                version, future = payload
                if self._consume is not None:
                    future.set_exception(RuntimeError("a Consume is already waiting"))
                elif version != self.manager.version:
                    future.set_exception(
                        ValueError(
                            f"the trainer asked for buffer {version} but the staleness manager "
                            f"is at version {self.manager.version}: trainer and control plane "
                            "disagree on the version (was the trainer restarted?)"
                        )
                    )
                else:
                    self._consume = (version, future)

    def _serve_consume(self) -> None:
        if self._consume is None or not self.manager.is_ready():
            return
        _, future = self._consume
        self._consume = None
        if not future.set_running_or_notify_cancel():
            return  # the trainer gave up waiting; the buffer stays Ready for its retry
        batch = self.manager.consume()
        if batch.aborted_groups:
            self._drop_groups(batch.aborted_groups)
        future.set_result(batch)

    # -- applying outcomes -------------------------------------------------------------

    def _occupy(self, records: Sequence[Rewarded]) -> None:
        for r in records:
            outcome = self.manager.complete(r.group_id, r.traj_id)
            self.metrics.on_rewarded(r)
            # Redundancy surplus (§4.3): groups that can no longer fit, members no longer
            # needed, or this very trajectory when its group was already settled.
            if outcome.abort_groups:
                self._drop_groups(outcome.abort_groups)
            if outcome.abort_trajectories:
                self._drop_trajectories(outcome.abort_trajectories)

    def _drop_groups(self, groups: Iterable[int]) -> None:
        """Groups the manager dropped (batch redundancy): forget them everywhere."""
        gone: list[AbortedTrajectory] = []
        for gid in groups:
            try:
                gone.extend(self._ts.abort_group(gid))
            except TrajectoryServerError:
                continue  # already consumed or aborted
        self._abort_on_instances(t.traj_id for t in gone if t.instance_id is not None)

    def _drop_trajectories(self, trajs: Iterable[int]) -> None:
        """Group-redundancy surplus: members no longer needed once their group is full."""
        gone: list[AbortedTrajectory] = []
        for tid in trajs:
            try:
                gone.extend(self._ts.abort([tid]))
            except TrajectoryServerError:
                continue
        self._abort_on_instances(t.traj_id for t in gone if t.instance_id is not None)

    def _abort_on_instances(self, trajs: Iterable[int]) -> None:
        ids = list(trajs)
        if ids:
            self.coordinator.request_abort(trajs=ids)

    def _record_step(self, report: StepReport) -> None:
        times = {i: h.times() for i, h in self._instances.items()}
        self.metrics.on_step(
            report,
            now=self._clock(),
            instance_times=times,
            command_seconds=dict(self.planes.seconds),
            coordinator=self.coordinator.stats,
            ps_version=self._latest_version,
            # asked now, not read from the last cycle's snapshot: a whole step can fit in
            # one coordinator period, and the record would then miss the newest Pull
            instance_versions={s.inst: s.inst_version for s in self._gather()},
        )

    # -- what the coordinator reads ----------------------------------------------------

    def snapshot(self) -> Snapshot:
        snaps = tuple(self._gather())
        self._last_snapshot = snaps
        return Snapshot(snaps, self._clock())

    def routable(self) -> Sequence[RoutableTrajectory]:
        view = self._ts.routing_view()
        self._group_of.clear()  # only this cycle's Routes look trajectories up
        for t in view:
            self._group_of[t.traj_id] = t.group_id
        return view

    def latest_version(self) -> int:
        return self._latest_version

    # -- diagnostics -------------------------------------------------------------------

    def staleness_of_consumed(self) -> Counter[int]:
        return Counter(self.metrics.staleness_total)
