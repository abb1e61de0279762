"""RolloutPipe's complete-group pipelining (``trainer.stream``): one optimizer step whose
groups arrive in parts.

A streaming trainer at version ``v`` runs forward/backward on each occupied group of
buffer ``v`` as soon as it is there (rolloutpipe.md §3.2) and takes the optimizer step
once the buffer was Consumed. The weights do not move until then, so every part is scored
by the same policy as a whole-batch step, and staleness is unchanged.

The step equals :func:`staleflow.trainers.rl.train_step` on the whole batch:

- advantages are group-relative, and a group never spans two parts;
- the aggregation divides by the token count (or, per sequence, the sequence count) of
  the *whole* batch, unknown until the last part: each part backpropagates its *sum*,
  and :meth:`finish` scales the accumulated gradients by ``1 / total`` before clipping
  and the update. The gradient is the same sum, divided once, so it matches to float
  rounding;
- the reference policy (the KL term) scores each part as it arrives: it is frozen, so
  its logprobs are those of the whole batch.

Only ``updates_per_step == 1`` streams: with several mini-batch updates per step, the
second update's forward passes need the first one's weights, which exist only once the
whole batch is in.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from staleflow.config.sections import TrainerConfig
from staleflow.trainers.batch_checks import validate_batch
from staleflow.trainers.rl import (
    BatchTally,
    LossTally,
    StepBackend,
    accumulate,
    batch_units,
    build_sequences,
    step_metrics,
    with_reference,
)
from trajectory_server.types import TrainingBatch

STREAM_NEEDS = "trainer.stream needs trainer.updates_per_step = 1"


class StreamBackend(StepBackend, Protocol):
    def scale_grads(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (before :meth:`update`)."""
        ...


def _merge(into: BatchTally, part: BatchTally) -> None:
    for k, v in part.sums.items():
        into.sums[k] += v
    for k, v in part.maxes.items():
        into.maxes[k] = max(into.maxes[k], v)


class StreamedStep:
    """Forward/backward of parts of one batch (:meth:`add`), then one update
    (:meth:`finish`). Single use: a step streams once."""

    def __init__(
        self,
        backend: StreamBackend,
        settings: TrainerConfig,
        *,
        version: int,
        pad_id: int,
        reference: StepBackend | None = None,
    ) -> None:
        if settings.updates_per_step != 1:
            raise ValueError(f"{STREAM_NEEDS} (got {settings.updates_per_step})")
        self._backend, self._settings = backend, settings
        self._version, self._pad_id = version, pad_id
        self._reference = reference
        self._batch = BatchTally()
        self._loss = LossTally()
        self._units = 0.0  # trained tokens (or sequences) of this rank's parts so far
        self.parts = 0
        self.groups = 0
        self._done = False
        backend.zero_grad()

    def add(self, part: TrainingBatch) -> None:
        """Forward/backward on the groups of ``part`` (whole groups, never seen before in
        this step); their gradients accumulate. Raises ``BatchError`` for a malformed
        part before touching the gradients."""
        if self._done:
            raise RuntimeError("this step was finished; start a new StreamedStep")
        backend, settings = self._backend, self._settings
        validate_batch(part, backend.vocab_size, allow_empty=True)
        sequences, tally = build_sequences(part, settings.advantage, self._version)
        _merge(self._batch, tally)
        self.parts += 1
        self.groups += len(part.groups)
        sequences = with_reference(
            self._reference,
            sequences,
            settings,
            pad_id=self._pad_id,
            temperature=part.temperature,
        )
        # total_tokens=1: the part's sum; finish() divides once
        accumulate(
            backend,
            sequences,
            settings,
            pad_id=self._pad_id,
            temperature=part.temperature,
            total_tokens=1.0,
            tally=self._loss,
        )
        self._units += batch_units(settings, sequences)

    def finish(self) -> tuple[dict[str, float], list[float]]:
        """Divide the gradients by the whole batch's token count, clip and update.
        Returns the step's metrics and its gradient norms, as ``train_step`` does."""
        if self._done:
            raise RuntimeError("this step was finished already")
        self._done = True
        backend = self._backend
        batch = self._batch.reduced(backend)
        loss = backend.from_last_stage(self._loss)
        total = float(backend.reduce(np.array([self._units]), "sum")[0])
        norms: list[float] = []
        if batch.sums["trained_trajectories"]:  # none to train: no update, like train_step
            backend.scale_grads(1.0 / max(total, 1.0))
            norms.append(backend.update())
        else:
            backend.zero_grad()
        for key in ("loss", "kl_loss"):  # tallied as sums, reported as the mean
            loss.sums[key] /= max(total, 1.0)
        metrics = step_metrics(backend, batch, loss, norms)
        metrics["train/streamed_parts"] = float(self.parts)
        return metrics, norms
