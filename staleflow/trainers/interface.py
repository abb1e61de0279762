"""The trainer contract of a trainer that lives in one process (the embedded one), and
the records every trainer hands the training loop.

A pool of ranks (``staleflow.trainers.megatron.MegatronTrainer``) is driven through
``staleflow.runtime.workers.training_loop.StepDriver`` instead: its ranks take their parts
of the batch and Push their shards themselves. Both report :data:`METRIC_KEYS`, and both
describe a step with :class:`TrainedStep` (its metrics and the :class:`BatchDigest` of
the batch), reading the TS through a :class:`BatchSource` (with :class:`StreamedGroups`
when they train on groups before their buffer is Consumed). Importable without torch and
without the runtime; trainers exchange weights as numpy arrays.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from trajectory_server.types import AbortedTrajectory, TrainingBatch, TrainingGroup

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
# Reported besides, by a trainer with a reference policy (``trainer.kl_coef > 0`` or
# ``trainer.ref``): the mean per-token KL to it (k3) and the KL term of the loss.
REFERENCE_METRIC_KEYS: tuple[str, ...] = ("train/ref_kl", "train/kl_loss")


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
        names), unaffected by later steps: safe to push while the next step runs. With
        ``trainer.lora``, what a version carries: the adapter alone, by adapter-file name
        (``staleflow.models.lora``; the frozen base is published once, apart)."""
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


# -- what a trainer hands the training loop (staleflow.runtime.workers.training_loop) --


class BatchSource(Protocol):
    """The TS as the trainer sees it (``TrajectoryServer`` or its client)."""

    def take_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
        read: Iterable[int] = (),
    ) -> TrainingBatch: ...

    def read_batch(
        self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]] | None = None
    ) -> TrainingBatch: ...


@dataclass(frozen=True, slots=True)
class BatchDigest:
    """What the loop reports of a consumed batch, without its payloads."""

    traj_ids: tuple[int, ...] = ()
    staleness: Mapping[int, int] = field(default_factory=dict)  # per trajectory
    token_staleness: Mapping[int, int] = field(default_factory=dict)  # per generated token
    tokens: int = 0
    dropped: tuple[AbortedTrajectory, ...] = ()

    @classmethod
    def of(cls, batch: TrainingBatch, version: int) -> BatchDigest:
        trajs = [t for g in batch.groups for t in g.trajectories]
        tokens: Counter[int] = Counter()
        for t in trajs:  # generated tokens only: observations are nobody's version
            tokens.update((version - np.asarray(t.versions)[np.asarray(t.mask)]).tolist())
        return cls(
            traj_ids=tuple(t.traj_id for t in trajs),
            staleness=dict(Counter(version - t.v_traj for t in trajs)),
            token_staleness=dict(tokens),
            tokens=int(sum(len(t.tokens) for t in trajs)),
            dropped=tuple(batch.dropped),
        )

    @classmethod
    def merge(cls, parts: Iterable[BatchDigest]) -> BatchDigest:
        """The digest of a batch taken in parts (one per data-parallel rank)."""
        parts = list(parts)
        staleness: Counter[int] = Counter()
        tokens: Counter[int] = Counter()
        for p in parts:
            staleness.update(p.staleness)
            tokens.update(p.token_staleness)
        return cls(
            traj_ids=tuple(i for p in parts for i in p.traj_ids),
            staleness=dict(staleness),
            token_staleness=dict(tokens),
            tokens=sum(p.tokens for p in parts),
            dropped=tuple(d for p in parts for d in p.dropped),
        )


@dataclass(frozen=True, slots=True)
class TrainedStep:
    metrics: Mapping[str, float]
    digest: BatchDigest


class StreamedGroups:
    """The groups a streaming trainer read from the TS before their buffer was Consumed.
    The Consume then takes them without their payloads (``take_batch(read=...)``), so a
    streamed batch crosses the wire once; the digest and the audit still see all of it."""

    def __init__(self) -> None:
        self._groups: dict[int, TrainingGroup] = {}

    def read(self, ts: BatchSource, select: Mapping[int, Sequence[int]]) -> TrainingBatch:
        part = ts.read_batch(list(select), select)
        self._groups.update((g.group_id, g) for g in part.groups)
        return part

    def take(
        self, ts: BatchSource, select: Mapping[int, Sequence[int]], streamed: Collection[int]
    ) -> tuple[TrainingBatch, TrainingBatch]:
        """Take the consumed groups ``select``: the whole batch, and the part of it the
        trainer has not trained on yet (the groups not ``streamed``)."""
        streamed = set(streamed)
        read = [g for g in select if g in streamed and g in self._groups]
        taken = ts.take_batch(list(select), select, read)
        groups = {g: self._groups[g] for g in read} | {g.group_id: g for g in taken.groups}
        self._groups.clear()
        whole = tuple(groups[g] for g in select)  # in the order asked, as take_batch hands
        rest = tuple(g for g in taken.groups if g.group_id not in streamed)
        return (
            TrainingBatch(whole, taken.dropped, taken.temperature),
            TrainingBatch(rest, taken.dropped, taken.temperature),
        )

    def clear(self) -> None:
        self._groups.clear()
