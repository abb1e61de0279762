"""A training batch as sequences for the model (:func:`build_sequences`): group-relative
advantages, the loss mask of each response, the batch statistics that add up across
data-parallel ranks; then cut (:func:`mini_batches`, :func:`micro_batches`) and padded
(:func:`pad`) for the forward passes of :mod:`staleflow.trainers.rl`.

Only whole sequences are padded side by side, never packed into one row, so a
sequence's loss mask stays its own: :func:`pad` lays it on the positions whose logits
predict the response tokens, and every other position (prompt, observations, padding)
is False.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal, Protocol

import numpy as np
import torch

from staleflow.trainers.losses import group_advantages
from trajectory_server.types import TrainingBatch

ADV_EPS = 1e-6


class Reducer(Protocol):
    """What :meth:`BatchTally.reduced` needs of a backend (``rl.StepBackend.reduce``)."""

    def reduce(self, values: np.ndarray, op: Literal["sum", "max", "min"]) -> np.ndarray: ...


# -- the batch --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class TrainSequence:
    """One trajectory ready for the model: ``prompt + response`` ids and, per response
    token, the loss mask, the behaviour logprob (0 where the mask is False), the proximal
    one when computed apart, and the reference policy's when there is one."""

    traj_id: int
    ids: np.ndarray  # prompt + response, int64
    prompt_len: int
    behav: np.ndarray  # float32 logprobs of the response tokens
    advantage: float
    mask: np.ndarray  # bool per response token: True for the model's (trained) tokens
    prox: np.ndarray | None = None
    ref: np.ndarray | None = None

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def trained(self) -> int:
        """Response tokens the loss covers (the model's own)."""
        return int(np.count_nonzero(self.mask))


# Batch statistics that add up across data-parallel ranks (and the two that take a max).
_BATCH_SUMS = (
    "reward_sum",
    "reward_sq_sum",
    "trajectories",
    "trained_trajectories",  # those with at least one trained token
    "advantage_abs_sum",
    "flat_groups",
    "groups",
    "response_len_sum",
    "reward_errors",
    "staleness_sum",
    "staleness_tokens",
)
_BATCH_MAXES = ("response_len_max", "token_staleness_max")


@dataclass(slots=True)
class BatchTally:
    """Additive statistics of (a data-parallel rank's part of) a batch."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_BATCH_SUMS, 0.0))
    maxes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_BATCH_MAXES, 0.0))

    def reduced(self, backend: Reducer) -> BatchTally:
        sums = backend.reduce(np.array([self.sums[k] for k in _BATCH_SUMS]), "sum")
        maxes = backend.reduce(np.array([self.maxes[k] for k in _BATCH_MAXES]), "max")
        return BatchTally(
            dict(zip(_BATCH_SUMS, sums.tolist(), strict=True)),
            dict(zip(_BATCH_MAXES, maxes.tolist(), strict=True)),
        )

    def metrics(self) -> dict[str, float]:
        s, nan = self.sums, float("nan")
        n = s["trajectories"]
        mean = s["reward_sum"] / n if n else nan
        var = max(s["reward_sq_sum"] / n - mean * mean, 0.0) if n else nan
        return {
            "train/reward_mean": mean,
            "train/reward_std": math.sqrt(var) if n else nan,
            "train/advantage_abs_mean": s["advantage_abs_sum"] / n if n else 0.0,
            "train/flat_group_frac": s["flat_groups"] / max(s["groups"], 1.0),
            "train/response_len_mean": s["response_len_sum"] / n if n else 0.0,
            "train/response_len_max": self.maxes["response_len_max"],
            "train/trajectories": n,
            "train/reward_errors": s["reward_errors"],
            "train/groups": s["groups"],
            "train/token_staleness_mean": s["staleness_sum"] / max(s["staleness_tokens"], 1.0),
            "train/token_staleness_max": self.maxes["token_staleness_max"],
        }


def build_sequences(
    batch: TrainingBatch, advantage: str, version: int
) -> tuple[list[TrainSequence], BatchTally]:
    """The trajectories of ``batch`` as sequences with their group-relative advantages.

    A trajectory whose reward function raised (``info["reward_error"]``) is left out: its
    reward says nothing about the response, and counting it in its group's mean would
    shift its siblings' advantages. A trajectory with no trained token (its mask all
    False) counts in its group's advantages, then is left out of the sequences: it has
    nothing to train.
    """
    rewards: list[float] = []
    group_index: list[int] = []
    trajs = []
    tally = BatchTally()
    for g, group in enumerate(batch.groups):
        for t in group.trajectories:
            if t.info.get("reward_error"):
                tally.sums["reward_errors"] += 1
                continue
            rewards.append(float(t.reward))
            group_index.append(g)
            trajs.append((group, t))
    advantages = group_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(group_index, dtype=torch.int64),
        normalize_std=advantage == "grpo",
        eps=ADV_EPS,
    ).tolist()
    sequences = []
    for (group, t), adv in zip(trajs, advantages, strict=True):
        prompt = np.asarray(group.prompt, dtype=np.int64)
        tokens = np.asarray(t.tokens, dtype=np.int64)
        mask = np.asarray(t.mask, dtype=np.bool_)
        s, m = tally.sums, tally.maxes
        s["response_len_sum"] += len(tokens)
        m["response_len_max"] = max(m["response_len_max"], float(len(tokens)))
        if not mask.any():
            continue
        sequences.append(
            TrainSequence(
                traj_id=t.traj_id,
                ids=np.concatenate([prompt, tokens]),
                prompt_len=len(prompt),
                behav=np.where(
                    mask, np.minimum(np.asarray(t.logprobs, np.float32), 0.0), 0.0
                ).astype(np.float32),
                advantage=float(adv),
                mask=mask,
            )
        )
        # staleness of the generated tokens only: an observation's version is a convention
        stale = version - np.asarray(t.versions, dtype=np.float64)[mask]
        s["staleness_sum"] += float(stale.sum())
        s["staleness_tokens"] += len(stale)
        m["token_staleness_max"] = max(m["token_staleness_max"], float(stale.max()))
    by_group: dict[int, set[float]] = {}
    for g, r in zip(group_index, rewards, strict=True):
        by_group.setdefault(g, set()).add(r)
    s = tally.sums
    s["trajectories"] = float(len(trajs))
    s["trained_trajectories"] = float(len(sequences))
    s["reward_sum"] = float(np.sum(rewards)) if rewards else 0.0
    s["reward_sq_sum"] = float(np.sum(np.square(rewards))) if rewards else 0.0
    s["advantage_abs_sum"] = float(np.sum(np.abs(advantages))) if rewards else 0.0
    s["groups"] = float(len(batch.groups))
    s["flat_groups"] = float(len(batch.groups) - sum(1 for v in by_group.values() if len(v) > 1))
    return sequences, tally


# -- cutting and padding ------------------------------------------------------------------


def micro_batches(
    sequences: Sequence[TrainSequence], max_tokens: int, max_size: int | None
) -> Iterator[list[TrainSequence]]:
    """Sequences sorted by length, cut so that ``count * longest <= max_tokens``."""
    ordered = sorted(sequences, key=lambda s: len(s.ids))  # stable: deterministic
    chunk: list[TrainSequence] = []
    for seq in ordered:
        full = max_size is not None and len(chunk) >= max_size
        if chunk and (full or (len(chunk) + 1) * len(seq.ids) > max_tokens):
            yield chunk
            chunk = []
        chunk.append(seq)
    if chunk:
        yield chunk


def mini_batches(sequences: Sequence[TrainSequence], parts: int) -> list[list[TrainSequence]]:
    """Exactly ``parts`` contiguous slices of the sequences (some may be empty on a
    data-parallel rank with few sequences: every rank must take the same number of
    updates). Groups stay mostly together; their advantages are computed already."""
    bounds = np.linspace(0, len(sequences), parts + 1).round().astype(int)
    return [list(sequences[a:b]) for a, b in pairwise(bounds.tolist())]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Right-padded ids and, aligned with the next-token logits (width - 1), the loss mask
    (the model's response tokens: padding, prompt and observations are False), targets,
    behaviour logprobs, advantages and (when given) proximal and reference logprobs."""

    ids: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    prox: torch.Tensor | None
    ref: torch.Tensor | None = None

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[:, 1:]


def pad(chunk: Sequence[TrainSequence], pad_id: int) -> MicroBatch:
    """The micro-batch of ``chunk``; padding sits after every real token, so with causal
    attention any ``pad_id`` works."""
    width = max(len(s.ids) for s in chunk)
    ids = np.full((len(chunk), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(chunk), width - 1), dtype=bool)
    behav = np.zeros((len(chunk), width - 1), dtype=np.float32)
    adv = np.zeros((len(chunk), width - 1), dtype=np.float32)
    prox = np.zeros((len(chunk), width - 1), dtype=np.float32)
    ref = np.zeros((len(chunk), width - 1), dtype=np.float32)
    for i, s in enumerate(chunk):
        ids[i, : len(s.ids)] = s.ids
        span = _response_span(s)  # the logits at position t predict token t + 1
        mask[i, span] = s.mask
        behav[i, span] = s.behav
        adv[i, span] = s.advantage
        if s.prox is not None:
            prox[i, span] = s.prox
        if s.ref is not None:
            ref[i, span] = s.ref
    has_prox, has_ref = chunk[0].prox is not None, chunk[0].ref is not None
    return MicroBatch(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.from_numpy(behav),
        torch.from_numpy(adv),
        torch.from_numpy(prox) if has_prox else None,
        torch.from_numpy(ref) if has_ref else None,
    )


def _response_span(s: TrainSequence) -> slice:
    return slice(s.prompt_len - 1, len(s.ids) - 1)
