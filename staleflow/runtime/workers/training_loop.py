"""The trainer's loop (§3, step 6): wait for buffer ``v``, Consume it, fetch its
trajectories from the TS, train, and Push version ``v+1`` while the next step runs.

The loop drives a :class:`StepDriver`. An in-process trainer (the embedded one) gets the
:class:`LocalStepDriver`: the loop's process takes the batch from the TS, trains on it
and hands the new weights to a background pusher. A pool of ranks (Megatron) is its own
driver: each data-parallel rank takes its part of the batch from the TS, and each rank
Pushes its own shards; the loop only moves ids and metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from staleflow.runtime.interface import ControlHandle, StepReport, StopRequested
from staleflow.trainers.interface import (
    BatchDigest,
    BatchSource,
    StreamedGroups,
    StreamingTrainer,
    TrainedStep,
)
from trajectory_server.types import TrainingBatch

logger = logging.getLogger(__name__)

# The longest a streaming trainer's wait for new groups blocks in the control plane before
# it asks again (it returns as soon as a group arrives or the buffer is Ready)
_STREAM_WAIT_S = 1.0


class TrainerLike(Protocol):
    version: int

    def train_step(self, batch: TrainingBatch) -> Mapping[str, float]: ...

    def export_weights(self) -> Mapping[str, np.ndarray]: ...


class PushHandleLike(Protocol):
    def wait(self, timeout: float | None = None) -> int | None: ...


class Pusher(Protocol):
    def push_async(
        self, version: int | None, weights: Mapping[str, np.ndarray]
    ) -> PushHandleLike: ...


@runtime_checkable
class StepDriver(Protocol):
    """One trainer, in one process or a pool, as the loop drives it."""

    @property
    def version(self) -> int: ...

    def train_consumed(
        self, select: Mapping[int, Sequence[int]], streamed: Collection[int] = ()
    ) -> TrainedStep:
        """Take the consumed groups ``select`` (group id -> trajectory ids) from the TS,
        train one step on them; :attr:`version` moves on by one. The groups in
        ``streamed`` were given to :meth:`StreamingDriver.stream` already."""
        ...

    def publish(self, version: int) -> PushHandleLike:
        """Push the current weights as ``version`` (in the background); the handle waits
        until the PS holds it."""
        ...


@runtime_checkable
class StreamingDriver(StepDriver, Protocol):
    """A driver whose trainer trains groups of its next batch as they arrive
    (``trainer.stream``, :mod:`staleflow.trainers.streamed`)."""

    def stream(self, select: Mapping[int, Sequence[int]]) -> None:
        """Forward/backward on these occupied, not yet Consumed groups."""
        ...

    def drop_stream(self) -> None:
        """Forget what was streamed: the step will not be taken."""
        ...

    @property
    def streams(self) -> bool:
        """Can this driver's trainer stream at all?"""
        ...


class LocalStepDriver:
    """A :class:`StepDriver` (streaming, when the trainer can) for a trainer in this
    process."""

    def __init__(self, trainer: TrainerLike, ts: BatchSource, pusher: Pusher) -> None:
        self.trainer, self._ts, self._pusher = trainer, ts, pusher
        self._read = StreamedGroups()

    @property
    def version(self) -> int:
        return self.trainer.version

    def train_consumed(
        self, select: Mapping[int, Sequence[int]], streamed: Collection[int] = ()
    ) -> TrainedStep:
        v = self.trainer.version
        batch, rest = self._read.take(self._ts, select, streamed)
        metrics = dict(self.trainer.train_step(rest))
        return TrainedStep(metrics, BatchDigest.of(batch, v))

    @property
    def streams(self) -> bool:
        return isinstance(self.trainer, StreamingTrainer)

    def stream(self, select: Mapping[int, Sequence[int]]) -> None:
        trainer: StreamingTrainer = self.trainer  # type: ignore[assignment]
        trainer.stream(self._read.read(self._ts, select))

    def drop_stream(self) -> None:
        trainer: StreamingTrainer = self.trainer  # type: ignore[assignment]
        trainer.drop_stream()
        self._read.clear()

    def publish(self, version: int) -> PushHandleLike:
        return self._pusher.push_async(version, self.trainer.export_weights())


class TrainingLoop:
    """``trainer`` is a :class:`StepDriver`, or an in-process trainer with the ``ts`` and
    ``pusher`` it needs."""

    def __init__(
        self,
        trainer: StepDriver | TrainerLike,
        *,
        control: ControlHandle,
        ts: BatchSource | None = None,
        pusher: Pusher | None = None,
        consume_timeout_s: float | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        stream: bool = False,
    ) -> None:
        if isinstance(trainer, StepDriver):
            self.driver: StepDriver = trainer
        else:
            if ts is None or pusher is None:
                raise ValueError("an in-process trainer needs ts= and pusher=")
            self.driver = LocalStepDriver(trainer, ts, pusher)
        self.trainer = trainer
        self._control = control
        self._timeout = consume_timeout_s
        self._on_step = on_step
        self._clock = clock
        self._pending: PushHandleLike | None = None
        self._stream = stream
        if stream and not getattr(self.driver, "streams", False):
            raise ValueError(
                f"trainer.stream: {type(self.trainer).__name__} cannot train a batch in parts "
                "(it has no stream(); the embedded and Megatron trainers do): set "
                "trainer.stream=false"
            )

    def run(self, steps: int) -> list[StepReport]:
        """Up to ``steps`` steps; fewer when the run is stopped (``StopRequested``)."""
        reports = []
        try:
            for _ in range(steps):
                reports.append(self.step())
        except StopRequested:
            logger.info("stopping after %d steps: the run was asked to stop", len(reports))
        self.finish()
        return reports

    def step(self) -> StepReport:
        v = self.driver.version
        started = self._clock()
        streamed: dict[int, tuple[int, ...]] = {}
        waited, timeout = 0.0, self._timeout
        try:
            if self._stream:
                waited, quiet = self._stream_groups(v, streamed)
                if timeout is not None:  # the stall clock runs from the last group
                    timeout = max(timeout - quiet, 1.0)
            before = self._clock()
            consumed = self._control.consume(v, timeout)
            waited += self._clock() - before
        except BaseException:
            if streamed:
                self.driver.drop_stream()  # type: ignore[attr-defined]
            raise
        select = {g.group_id: g.trajectories for g in consumed.groups}
        for gid, trajs in streamed.items():
            if tuple(select.get(gid, ())) != tuple(trajs):
                raise RuntimeError(
                    f"group {gid} was streamed with trajectories {list(trajs)} but buffer {v} "
                    f"was consumed with {list(select.get(gid, []))}: an occupied group left "
                    "its buffer, which the staleness manager never does"
                )
        trained_step = self.driver.train_consumed(select, tuple(streamed))
        digest = trained_step.digest
        if digest.dropped:
            self._control.dropped(digest.dropped)
        trained = self._clock()
        push_wait = 0.0
        if self._pending is not None:
            # One Push in flight at a time: the PS keeps few slots, and a trainer that
            # outruns its Pushes would only queue weight copies.
            self._pending.wait()
            push_wait = self._clock() - trained
        self._pending = self.driver.publish(v + 1)
        report = StepReport(
            version=v,
            wait_s=waited,
            train_s=trained - started - waited,
            push_wait_s=push_wait,
            trajectories=len(digest.traj_ids),
            tokens=digest.tokens,
            staleness=dict(digest.staleness),
            metrics=dict(trained_step.metrics),
            consumed_traj_ids=digest.traj_ids,
            token_staleness=dict(digest.token_staleness),
            streamed_groups=len(streamed) if self._stream else None,
        )
        self._control.trained(report)
        if self._on_step is not None:
            self._on_step(report)
        return report

    def _stream_groups(self, v: int, streamed: dict[int, tuple[int, ...]]) -> tuple[float, float]:
        """Train buffer ``v``'s groups as they are occupied, until it is Ready (or quiet
        for the stall timeout: the Consume then reports it). Fills ``streamed``; returns
        the seconds spent waiting, and those since the last new group."""
        driver: StreamingDriver = self.driver  # type: ignore[assignment]
        waited = quiet = 0.0
        while True:
            before = self._clock()
            head = self._control.trainer_groups(v, len(streamed), _STREAM_WAIT_S)
            idle = self._clock() - before
            waited += idle
            if head.ready:  # the groups that made it Ready go with the step
                return waited, quiet
            new = {g.group_id: g.trajectories for g in head.groups if g.group_id not in streamed}
            if new:
                driver.stream(new)
                streamed.update(new)
                quiet = 0.0
            else:
                quiet += idle
            if self._timeout is not None and quiet >= self._timeout:
                return waited, quiet

    def finish(self) -> None:
        """Wait for the last Push, so the PS holds the final version."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
