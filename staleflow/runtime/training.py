"""The trainer's loop (§3, step 6): wait for buffer ``v``, Consume it, fetch its
trajectories from the TS, train, and Push version ``v+1`` while the next step runs."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from staleflow.runtime.interface import ControlHandle, StepReport, StopRequested
from trajectory_server.types import TrainingBatch

logger = logging.getLogger(__name__)


class TrainerLike(Protocol):
    version: int

    def train_step(self, batch: TrainingBatch) -> Mapping[str, float]: ...

    def export_weights(self) -> Mapping[str, np.ndarray]: ...


class BatchSource(Protocol):
    def take_batch(
        self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]] | None = None
    ) -> TrainingBatch: ...


class PushHandleLike(Protocol):
    def wait(self, timeout: float | None = None) -> int: ...


class Pusher(Protocol):
    def push_async(
        self, version: int | None, weights: Mapping[str, np.ndarray]
    ) -> PushHandleLike: ...


class TrainingLoop:
    def __init__(
        self,
        trainer: TrainerLike,
        *,
        control: ControlHandle,
        ts: BatchSource,
        pusher: Pusher,
        consume_timeout_s: float | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.trainer = trainer
        self._control, self._ts, self._pusher = control, ts, pusher
        self._timeout = consume_timeout_s
        self._on_step = on_step
        self._clock = clock
        self._pending: PushHandleLike | None = None

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
        v = self.trainer.version
        started = self._clock()
        consumed = self._control.consume(v, self._timeout)
        waited = self._clock() - started
        select = {g.group_id: g.trajectories for g in consumed.groups}
        batch = self._ts.take_batch(list(select), select)
        if batch.dropped:
            self._control.dropped(batch.dropped)
        trajs = [t for g in batch.groups for t in g.trajectories]
        staleness = Counter(v - t.v_traj for t in trajs)
        token_staleness: Counter[int] = Counter()
        for t in trajs:
            token_staleness.update((v - t.versions).tolist())
        metrics = dict(self.trainer.train_step(batch))
        trained = self._clock()
        push_wait = 0.0
        if self._pending is not None:
            # One Push in flight at a time: the PS keeps few slots, and a trainer that
            # outruns its Pushes would only queue weight copies.
            self._pending.wait()
            push_wait = self._clock() - trained
        self._pending = self._pusher.push_async(v + 1, self.trainer.export_weights())
        report = StepReport(
            version=v,
            wait_s=waited,
            train_s=trained - started - waited,
            push_wait_s=push_wait,
            trajectories=len(trajs),
            tokens=int(sum(len(t.tokens) for t in trajs)),
            staleness=dict(staleness),
            metrics=metrics,
            consumed_traj_ids=tuple(t.traj_id for t in trajs),
            token_staleness=dict(token_staleness),
        )
        self._control.trained(report)
        if self._on_step is not None:
            self._on_step(report)
        return report

    def finish(self) -> None:
        """Wait for the last Push, so the PS holds the final version."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
