"""The control plane: the shared control loop (``staleflow.control.loop``) on one thread,
on wall time.

Everything that decides runs on that thread, so the staleness manager and the coordinator
never see concurrent calls from this side: other components (reward workers, the
trainer) only post messages to the inbox, and each iteration (:meth:`ControlPlane.run_once`)
reads like §5.2 / Figure 9:

1. apply what arrived: rewarded trajectories are Occupied, with redundancy's surplus
   dropped; trajectories the TS dropped are aborted on their instances;
2. hand the trainer its buffer when it is Ready (Consume);
3. run the coordinator's snapshot-command cycle when it is due, and carry the commands
   out (Pulls and Routes of different instances concurrently, via ``run_round``); then
   Consume again if the cycle made the buffer Ready.

The simulator drives the same loop in the same order on virtual time
(``staleflow.sim.cluster``). A failure on the loop stops the plane and is re-raised to
every caller, so a dead instance surfaces as an error in the trainer and the launcher
rather than a hang.
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
from typing import Any

from coordinator import CoordinatorConfig
from coordinator.types import InstanceSnapshot
from staleflow.control import ControlLoop, Decision, TrajectoryStore
from staleflow.runtime.interface import InstanceHandle, Rewarded, StepReport
from staleflow.runtime.metrics import StepMetrics
from staleflow.runtime.planes import RuntimePlanes
from staleflow.runtime.record import StepRecord
from staleness import ConsumedBatch, StalenessConfig
from staleness.types import ManagerView
from trajectory_server.types import AbortedTrajectory, TSStats

logger = logging.getLogger(__name__)


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
        ts: TrajectoryStore,
        instances: Mapping[int, InstanceHandle],
        ps_version: Callable[[], int],
        gather: Callable[[], Sequence[InstanceSnapshot]] | None = None,
        run_round: Callable[[Sequence[Callable[[], None]]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.config = config
        self._instances = instances
        self._gather = gather or (lambda: [h.snapshot() for h in instances.values()])
        self._clock = clock
        self.planes = RuntimePlanes(instances)
        self.loop = ControlLoop(
            config.staleness,
            config.coordinator,
            ts=ts,
            planes=self.planes,
            snapshots=self._gather,
            ps_version=ps_version,
            instances=instances,
            clock=clock,
            run_round=run_round,
            on_decision=on_decision,
        )
        self.manager = self.loop.manager
        self.coordinator = self.loop.coordinator
        self.executor = self.loop.executor
        self.metrics = StepMetrics(list(instances), clock())
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._consume: tuple[int, Future[ConsumedBatch]] | None = None
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- entry points (any thread) -----------------------------------------------------

    def rewarded(self, records: Sequence[Rewarded]) -> None:
        self._post("rewarded", tuple(records))

    def dropped(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        self._post("dropped", tuple(trajectories))

    def trained(self, report: StepReport) -> None:
        self._post("trained", report)

    def request_consume(self, version: int) -> Future[ConsumedBatch]:
        """Ask for buffer ``version``; the future completes once it was Consumed (or
        fails). Cancel it to withdraw the request before it is served."""
        future: Future[ConsumedBatch] = Future()
        self._post("consume", (version, future))
        return future

    def consume(self, version: int, timeout_s: float | None = None) -> ConsumedBatch:
        future = self.request_consume(version)
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
            instances=self.loop.last_snapshot,
            ts=None,
            ps_version=self.loop.latest_version(),
            steps=len(self.metrics.records),
            rewarded=self.metrics.rewarded_total,
            elapsed_s=self._clock() - self.metrics.started,
            cycles=self.coordinator.stats.cycles,
            discarded=self.coordinator.stats.discarded,
            last_discard=self.loop.last_discard,
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
        """One iteration (also what tests and the simulator's runtime twin drive directly,
        without the thread)."""
        self._drain_inbox()
        self._serve_consume()
        if self.loop.cycle():
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
                self.loop.occupy(payload)
                for r in payload:
                    self.metrics.on_rewarded(r)
            elif kind == "dropped":
                self.loop.forget(payload)
            elif kind == "trained":
                self._record_step(payload)
            elif kind == "consume":
                version, future = payload
                if self._consume is not None and not self._consume[1].cancelled():
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
        if self._consume is None:
            return
        if self._consume[1].cancelled():
            self._consume = None  # the trainer gave up waiting
            return
        if not self.manager.is_ready():
            return
        _, future = self._consume
        self._consume = None
        if not future.set_running_or_notify_cancel():
            return  # the trainer gave up waiting; the buffer stays Ready for its retry
        try:
            batch = self.loop.consume()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        assert batch is not None  # Ready was checked on this thread
        future.set_result(batch)

    def _record_step(self, report: StepReport) -> None:
        times = {i: h.times() for i, h in self._instances.items()}
        seer = self.coordinator.strategies.seer
        self.metrics.on_step(
            report,
            now=self._clock(),
            instance_times=times,
            command_seconds=dict(self.planes.seconds),
            coordinator=self.coordinator.stats,
            ps_version=self.loop.latest_version(),
            # asked now, not read from the last cycle's snapshot: a whole step can fit in
            # one coordinator period, and the record would then miss the newest Pull
            instance_versions={s.inst: s.inst_version for s in self._gather()},
            probes=seer.accuracy() if seer is not None else None,
        )

    # -- diagnostics -------------------------------------------------------------------

    def staleness_of_consumed(self) -> Counter[int]:
        return Counter(self.metrics.staleness_total)
