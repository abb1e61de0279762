"""The control plane: the shared control loop (``staleflow.control.loop``) on one thread,
on wall time.

Everything that decides runs on that thread, so the staleness manager and the coordinator
never see concurrent calls from this side: other components (reward workers, the
trainer, the supervisor) only post messages to the inbox, and each iteration
(:meth:`ControlPlane.run_once`) reads like §5.2 / Figure 9:

1. apply what arrived: rewarded trajectories are Occupied, with redundancy's surplus
   dropped; trajectories the TS dropped are aborted on their instances; instances that
   were lost leave (their trajectories go back to the TS) and new ones join;
2. hand the trainer its buffer when it is Ready (Consume);
3. run the coordinator's snapshot-command cycle when it is due, and carry the commands
   out (Pulls and Routes of different instances concurrently, via ``run_round``); then
   Consume again if the cycle made the buffer Ready.

The simulator drives the same loop in the same order on virtual time
(``staleflow.sim.cluster``). A failure on the loop stops the plane and is re-raised to
every caller, so an unexpected error surfaces in the trainer and the launcher rather
than a hang; a rollout instance that dies is not a failure but a recovery
(``staleflow.runtime.controller.fleet``).

Checkpoints (``docs/recovery.md``): after every ``checkpoint_every``-th training step,
and when the run is asked to stop, the plane takes a *cut* on this thread: the manager's
state, then the TS's, with nothing in between. Until the launcher has written it
(:meth:`ControlPlane.release_cut`), no further Consume is served; instances keep
generating. A stop first interrupts every instance, so that the partial responses are
whole in the TS, and refuses Consumes from then on (``StopRequested``).

Evaluation (``eval.every``, ``staleflow.runtime.controller.eval_hold``): the record of
every N-th step is published once the driver has handed in its held-out scores.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, cast

from coordinator.types import InstanceSnapshot
from staleflow.control import ControlLoop, Decision
from staleflow.control.dynamic_sampling import DynamicSampling
from staleflow.recovery.events import RecoveryEvent, RecoveryLog
from staleflow.rewards.estimators import EvalScores
from staleflow.rollout.instance import InstanceTimes
from staleflow.runfolder.step_record import StepRecord, freshness_keys, sampling_keys
from staleflow.runtime.controller import inbox
from staleflow.runtime.controller.eval_hold import EvalHold
from staleflow.runtime.controller.fleet import FleetOps, LostInstance, RecoverableStore
from staleflow.runtime.controller.instances import Members
from staleflow.runtime.controller.metrics import StepMetrics
from staleflow.runtime.controller.plane_records import ControlConfig, Cut, LiveState
from staleflow.runtime.controller.planes import RuntimePlanes
from staleflow.runtime.controller.races import RaceServer, RuntimeRaces
from staleflow.runtime.controller.tool_view import tool_view
from staleflow.runtime.interface import (
    InstanceGone,
    InstanceHandle,
    Rewarded,
    StepReport,
    StopRequested,
    TrainerGroups,
)
from staleness import ConsumedBatch, StalenessManager
from staleness.types import TrajId
from trajectory_server.types import AbortedTrajectory, InstanceId

logger = logging.getLogger(__name__)
T = TypeVar("T")

_STREAM_POLL_S = 0.02  # a streaming trainer's wait on its buffer: groups fill at reward speed


class ControlPlaneError(RuntimeError):
    """The control loop stopped; the message says why."""


class CheckpointStore(RecoverableStore, Protocol):
    def export_state(self) -> dict[str, Any]: ...


Snapshots = Callable[[Sequence[int]], Sequence[InstanceSnapshot | InstanceGone]]


class ControlPlane:
    """See the module docstring. ``gather(instances)`` takes every instance's snapshot
    at once and gives an :class:`InstanceGone` in place of an instance that could not
    answer. A resumed run passes the restored ``manager``, the instances' ``versions``
    and the ``records`` and ``recovery`` totals so far."""

    def __init__(
        self,
        config: ControlConfig,
        *,
        ts: CheckpointStore,
        instances: Mapping[int, InstanceHandle],
        ps_version: Callable[[], int],
        gather: Snapshots | None = None,
        run_round: Callable[[Sequence[Callable[[], None]]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_decision: Callable[[Decision], None] | None = None,
        holders: Mapping[int, InstanceId] | None = None,
        versions: Mapping[int, int] | None = None,
        manager: StalenessManager | None = None,
        records: Sequence[StepRecord] = (),
    ) -> None:
        self.config = config
        self.members = Members(instances, holders)
        self._ts = ts
        self._gather = gather or self.members.snapshots
        self._clock = clock
        self.planes = RuntimePlanes(self.members, on_gone=self._on_gone)
        self.tool_view = tool_view(config, ts, self.members)
        self.loop = ControlLoop(
            config.staleness,
            config.coordinator,
            ts=ts,
            planes=self.planes,
            snapshots=self._snapshots,
            ps_version=ps_version,
            instances=instances,
            versions=versions,
            clock=clock,
            run_round=run_round,
            on_decision=on_decision,
            manager=manager,
            sampling=DynamicSampling(config.sampling) if config.sampling is not None else None,
            speculation=config.speculation,
        )
        self.manager = self.loop.manager
        self.coordinator = self.loop.coordinator
        self.executor = self.loop.executor
        self.metrics = StepMetrics(list(instances), clock())
        self.metrics.continue_from(records)
        self.loop.speculation_measured(self.metrics.speculation_totals())  # a resumed run's
        self.evals = EvalHold(config.eval_every)
        self.recovery = RecoveryLog(records[-1].extra if records else None)
        self.fleet = FleetOps(self.members, self.loop, self.planes, ts, self.recovery, self._event)
        self.races = _races(self, ts, records[-1].extra if records else {})
        self._inbox: queue.SimpleQueue[inbox.Message] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._consume: tuple[int, Future[ConsumedBatch]] | None = None
        self._training = False  # a Consume was served; its trained report has not come
        self._cut: Cut | None = None  # taken, not yet released by the launcher
        self._stopping = False
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- entry points (any thread) -----------------------------------------------------

    def rewarded(self, records: Sequence[Rewarded]) -> None:
        self._post(inbox.RewardsIn(tuple(records)))

    def dropped(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        self._post(inbox.TrajectoriesDropped(tuple(trajectories)))

    def trained(self, report: StepReport) -> None:
        self._post(inbox.StepTrained(report))

    def lost(self, inst: int, reason: str) -> None:
        """``inst`` died or failed (the supervisor saw it): it leaves the run."""
        self._post(inbox.InstanceLost(inst, reason))

    def join(
        self,
        inst: int,
        handle: InstanceHandle,
        holder: InstanceId,
        version: int,
        kind: str = "instance_added",
    ) -> Future[None]:
        """``inst`` joins empty at ``version``; done once the coordinator routes to it."""
        return self._ask(inbox.JoinAsked(inst, handle, holder, version, kind))

    def remove(self, inst: int) -> Future[int]:
        """Take ``inst`` out (interrupted first); the future gives the trajectories it
        returned to the TS, once it is out and may be stopped."""
        return self._ask(inbox.RemoveAsked(inst))

    def replay_completions(self) -> Future[int]:
        """A reward worker died: apply the completions in the TS whose report it lost."""
        return self._ask(inbox.ReplayAsked())

    def note(self, kind: str, subject: str, detail: str = "", **amounts: float) -> None:
        """Record a recovery the supervisor carried out (a restart, a lost PS ...)."""
        self.recovery.add(self._event(kind, subject, detail), **amounts)

    def take_lost(self) -> list[LostInstance]:
        """The instances the plane gave up on since the last call (for restarts)."""
        self.check()
        return self.fleet.take_lost()

    def request_stop(self) -> None:
        """Stop routing, interrupt every instance, and take the final cut once the step
        in progress (if any) is reported; Consumes are refused from now on."""
        self._post(inbox.StopAsked())

    def pending_cut(self) -> Cut | None:
        self.check()
        return self._cut

    def release_cut(self, steps: int) -> None:
        """The cut of ``steps`` was written: Consumes may go on (unless stopping)."""
        self._post(inbox.CutReleased(steps))

    def request_consume(self, version: int) -> Future[ConsumedBatch]:
        """Ask for buffer ``version``; the future completes once it was Consumed (or
        fails). Cancel it to withdraw the request before it is served."""
        return self._ask(inbox.ConsumeAsked(version))

    def consume(self, version: int, timeout_s: float | None = None) -> ConsumedBatch:
        future = self.request_consume(version)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
            try:
                return future.result(left)
            except TimeoutError:
                self.check()  # the loop died after we posted: do not wait forever
                if deadline is not None and self._cut is not None:
                    deadline += left  # a checkpoint being written is not a stall
                if deadline is not None and time.monotonic() >= deadline:
                    if future.cancel():
                        raise TimeoutError(
                            f"buffer {version} was not Ready within {timeout_s:g} s: rollout "
                            "made no batch in that time (see the dashboard's buffers for the "
                            "Stuck one); if rollouts are just slow, raise "
                            "trainer.stall_timeout_s (0 waits forever)"
                        ) from None
                    return future.result()  # being consumed as we gave up: take it

    def trainer_groups(self, version: int, have: int, wait_s: float) -> TrainerGroups:
        """See :meth:`ControlHandle.trainer_groups`. Reads the manager (thread-safe) and
        changes nothing: the groups stay occupied, and in the TS, until the Consume."""
        deadline = time.monotonic() + wait_s
        while True:
            self.check()
            if self._stopping:
                raise StopRequested("the run is stopping: no more training steps")
            if version != self.manager.version:
                raise ValueError(
                    f"the trainer streams buffer {version} but the staleness manager is at "
                    f"version {self.manager.version}"
                )
            groups = self.manager.trainer_groups()
            ready = self.manager.is_ready()
            if len(groups) > have or ready or time.monotonic() >= deadline:
                return TrainerGroups(groups, ready)
            time.sleep(_STREAM_POLL_S)

    def records(self, since: int = 0) -> list[StepRecord]:
        """Per-step metric records from index ``since`` on, up to one waiting for its
        evaluation."""
        self.check()
        records = self.metrics.records
        return records[since : self.evals.published(len(records))]

    def eval_due(self) -> int | None:
        """The step whose record waits for its evaluation (None: none)."""
        self.check()
        return self.evals.due(len(self.metrics.records))

    def eval_done(self, step: int, scores: EvalScores | None) -> None:
        """The evaluation of ``step`` ended (None: it could not be taken)."""
        self._post(inbox.EvalScored(step, scores))

    def events(self, since: int = 0) -> list[RecoveryEvent]:
        return self.recovery.since(since)

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
            members=tuple(sorted(self.members)),
            stopping=self._stopping,
            recovery=self.recovery.totals(),
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
            if self._thread is None or not self._thread.is_alive():  # the loop is ours now
                # aborts decided since the last cycle (the last step's surplus) would never
                # be issued: carry them out, so that no instance keeps what the TS dropped
                self.loop.abort_pending()
                if self.races is not None:  # no cycle will end the races still running
                    self.races.drop_all()

    def settle(self) -> int:
        """After :meth:`stop` (the end-of-run audit): interrupt every member and take out
        the gone ones as the loop would (``FleetOps.lost``); returns what came back."""
        if self._thread is not None:  # stop() waits 10 s; a round in flight may take longer
            self._thread.join(60)
            if self._thread.is_alive():
                raise ControlPlaneError("the control loop did not stop: nothing to settle")
        returned = self.fleet.interrupt_all()
        self._drain_inbox()  # the losses the interrupts found, and those posted since
        return returned

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
            # Nobody may wait forever on a plane that stopped: fail every pending request.
            error = ControlPlaneError(f"control plane failed: {exc!r}")
            waiting = [self._consume[1]] if self._consume is not None else []
            while True:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, inbox.ASKS):
                    waiting.append(message.future)
            for future in waiting:
                if not future.done():
                    future.set_exception(error)

    def run_once(self) -> None:
        """One iteration (also what tests and the simulator's runtime twin drive directly,
        without the thread)."""
        self._drain_inbox()
        self._serve_consume()
        due = self._clock() >= self.coordinator.next_due
        if self.races is not None and not self._stopping and due:
            self.races.settle()  # before the cycle's commands, which may stop the holder
        if not self._stopping and self.loop.cycle():
            if self.races is not None:  # after routing: what routing filled is not idle
                self.races.after_cycle(self.loop.last_snapshot)
            self._serve_consume()

    def _post(self, message: inbox.Message) -> None:
        self.check()
        self._inbox.put(message)
        self._wake.set()

    def _ask(self, ask: inbox.Ask[T]) -> Future[T]:
        self._post(ask)
        return ask.future

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case inbox.RewardsIn(records):
                    for r in self.loop.occupy(records):
                        self.metrics.on_rewarded(r)
                    if self.tool_view is not None:
                        waits = self.coordinator.strategies.waits
                        self.tool_view.rewarded(records, waits, self.members)
                case inbox.TrajectoriesDropped(trajectories):
                    self.loop.forget(trajectories)
                case inbox.StepTrained(report):
                    self._trained(report)
                case inbox.ConsumeAsked(version, future):
                    self._queue_consume(version, future)
                case inbox.InstanceLost(inst, reason, reserved):
                    self.metrics.instance_lost(inst)
                    self.fleet.lost(inst, reason, reserved)
                    if self.races is not None:
                        self.races.instance_left(inst)
                case inbox.StopAsked():
                    self._begin_stop()
                case inbox.EvalScored(step, scores):
                    self.evals.done(self.metrics.records, step, scores)
                case inbox.CutReleased(steps):
                    if self._cut is not None and self._cut.steps == steps and not self._cut.final:
                        self._cut = None
                case inbox.JoinAsked() | inbox.RemoveAsked() | inbox.ReplayAsked():
                    self._answer(message)

    def _answer(self, ask: inbox.JoinAsked | inbox.RemoveAsked | inbox.ReplayAsked) -> None:
        future: Future[Any] = ask.future
        try:
            result: int | None = None
            match ask:
                case inbox.JoinAsked(inst, handle, holder, version, kind):
                    self.fleet.add(inst, handle, holder, version, kind)
                    self.metrics.instance_joined(inst)
                case inbox.RemoveAsked(inst):
                    if self.races is not None:
                        self.races.instance_left(inst)
                    last = self._times_of(inst)
                    result = self.fleet.remove(inst)
                    self.metrics.instance_removed(inst, last)
                case inbox.ReplayAsked():
                    result = self.fleet.replay_completions()
        except Exception as exc:  # the caller's mistake (e.g. an unknown instance)
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _queue_consume(self, version: int, future: Future[ConsumedBatch]) -> None:
        if self._stopping:
            future.set_exception(StopRequested("the run is stopping: no more training steps"))
        elif self._consume is not None and not self._consume[1].cancelled():
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
            self.loop.trainer_asks()

    def _serve_consume(self) -> None:
        if self._consume is None or self._cut is not None:
            return  # nothing asked, or a cut is being written: the trainer waits
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
        self._training = True
        future.set_result(batch)

    def _trained(self, report: StepReport) -> None:
        self._training = False
        self.evals.before_step(len(self.metrics.records) + 1)  # held before it is readable
        self._record_step(report)
        steps = len(self.metrics.records)
        every = self.config.checkpoint_every
        if self._stopping:
            self._finish_stop()
        elif every > 0 and steps % every == 0:
            self._take_cut(final=False)

    # -- checkpoints and the stop ------------------------------------------------------

    def _begin_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.races is not None:  # only the holders' partials are kept
            self.races.drop_all()
        returned = self.fleet.interrupt_all()
        self.recovery.add(
            self._event("stop", "run", f"{returned} trajectories interrupted and kept whole")
        )
        if not self._training:
            self._finish_stop()  # else when the step in progress is reported

    def _finish_stop(self) -> None:
        self._take_cut(final=True)
        if self._consume is not None:
            _, future = self._consume
            self._consume = None
            if future.set_running_or_notify_cancel():
                future.set_exception(StopRequested("the run is stopping: no more training steps"))

    def _take_cut(self, final: bool) -> None:
        """The manager's state, then the TS's, with nothing in between (this thread)."""
        staleness = self.manager.export_state()
        trajectories = self._ts.export_state()
        version = self.manager.version
        self._cut = Cut(
            steps=len(self.metrics.records),
            version=version,
            ps_version=min(self.loop.latest_version(), version),
            staleness=staleness,
            trajectories=trajectories,
            metrics=tuple(r.to_flat() for r in self.metrics.records),
            final=final,
        )
        logger.info("cut taken after step %d (version %d)", self._cut.steps, version)

    # -- instances -----------------------------------------------------------------------

    def _snapshots(self) -> list[InstanceSnapshot]:
        waiting = self.tool_view.waiting() if self.tool_view is not None else ()
        out = []
        for s in self._gather(list(self.members)):
            if isinstance(s, InstanceGone):
                self._post_lost(s, ())
            else:
                out.append(s)
        return out if self.tool_view is None else self.tool_view.merge(out, waiting)

    def _on_gone(self, exc: InstanceGone, reserved: Sequence[TrajId]) -> None:
        self._post_lost(exc, reserved)

    def _post_lost(self, exc: InstanceGone, reserved: Sequence[TrajId]) -> None:
        """Any thread (a command round's, the snapshot's): handled on the loop thread."""
        self._inbox.put(inbox.InstanceLost(exc.inst, exc.reason, tuple(reserved)))
        self._wake.set()

    def _event(self, kind: str, subject: str, detail: str) -> RecoveryEvent:
        return RecoveryEvent(
            self._clock() - self.metrics.started, kind, subject, detail, len(self.metrics.records)
        )

    def _times_of(self, inst: int) -> InstanceTimes | None:
        try:
            return self.members[inst].times()
        except InstanceGone as exc:
            if inst in self.members:  # else not a member: the caller names the mistake
                self._post_lost(exc, ())
            return None

    def _record_step(self, report: StepReport) -> None:
        times = {i: t for i in list(self.members) if (t := self._times_of(i)) is not None}
        seer = self.coordinator.strategies.seer
        fresh = self.coordinator.strategies.freshness
        # dynamic sampling's counts since the last step (None: off)
        w = self.loop.sampling.take_window() if self.loop.sampling is not None else None
        self.metrics.on_step(
            report,
            now=self._clock(),
            instance_times=times,
            command_seconds=dict(self.planes.seconds),
            coordinator=self.coordinator.stats,
            ps_version=self.loop.latest_version(),
            # asked now, not read from the last cycle's snapshot: a whole step can fit in
            # one coordinator period, and the record would then miss the newest Pull
            instance_versions={s.inst: s.inst_version for s in self._snapshots()},
            totals={
                **self.recovery.totals(),
                **(self.races.totals() if self.races else {}),
                **(freshness_keys(fresh.state) if fresh is not None else {}),
                **(sampling_keys(w.completed, w.filtered, w.flat_kept) if w else {}),
            },
            probes=seer.accuracy() if seer is not None else None,
        )
        self.loop.speculation_measured(self.metrics.speculation_totals())  # the cost model's

    # -- diagnostics -------------------------------------------------------------------

    def staleness_of_consumed(self) -> Counter[int]:
        return Counter(self.metrics.staleness_total)


def _races(plane: ControlPlane, ts: object, last: Mapping[str, float]) -> RuntimeRaces | None:
    rule = plane.coordinator.strategies.race
    if rule is None:
        return None
    estimator = plane.coordinator.strategies.estimator
    return RuntimeRaces(
        rule,
        cast(RaceServer, ts),  # the TS client serves the race calls too
        instances=lambda: plane.members,  # type: ignore[arg-type,return-value]
        holders=plane.members.holders,
        snapshots=plane._snapshots,
        routable=plane.loop.routable,
        speeds=estimator.relative if estimator is not None else None,
        totals=last,
        copy_method=plane.config.race_draft_method,
    )
