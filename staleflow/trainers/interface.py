"""The trainer contract of a trainer that lives in one process (the embedded one).

A pool of ranks (``staleflow.trainers.megatron.MegatronTrainer``) is driven through
``staleflow.runtime.workers.training_loop.StepDriver`` instead: its ranks take their parts of the batch
and Push their shards themselves. Both report :data:`METRIC_KEYS`. Importable without
torch; trainers exchange weights as numpy arrays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from trajectory_server.types import TrainingBatch

# The trained-token count of a step, as the trainer's own metrics name it.
TOKENS_METRIC = "train/tokens"

# Metric keys every trainer reports from ``train_step``; backends may add more under
# ``train/``.
METRIC_KEYS: tuple[str, ...] = (
    "train/loss",
    "train/grad_norm",
    "train/clip_frac",
    "train/importance_weight_mean",
    "train/entropy",
    "train/kl_behav",
    TOKENS_METRIC,
    "train/reward_mean",
    "train/response_len_mean",
)


@runtime_checkable
class Trainer(Protocol):
    @property
    def version(self) -> int:
        """The policy version of the current weights: the number of optimizer steps taken
        (plus the version the trainer started from)."""
        ...

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        """One optimizer step on one consumed batch; increments :attr:`version`. Returns
        metrics, at least :data:`METRIC_KEYS`. Raises ``ValueError`` naming the
        trajectory for a malformed batch, before changing anything."""
        ...

    def export_weights(self) -> dict[str, np.ndarray]:
        """A copy of the current weights by parameter name (``staleflow.models.policy_state``
        names), unaffected by later steps: safe to push while the next step runs."""
        ...

    def save_checkpoint(self, path: str | Path) -> None:
        """Write weights, optimizer state and version to directory ``path``."""
        ...


@runtime_checkable
class StreamingTrainer(Protocol):
    """What a :class:`Trainer` adds to take a step's groups in parts (``trainer.stream``):
    ``stream(part)`` runs forward/backward on groups of the next step's batch as they
    arrive; the following ``train_step(rest)`` adds the remaining groups and takes the
    update, with the loss of the whole batch (:mod:`staleflow.trainers.streamed`)."""

    def stream(self, part: TrainingBatch) -> None: ...

    def drop_stream(self) -> None:
        """Forget the parts streamed so far: that step will not be taken."""
        ...
