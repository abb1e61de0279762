"""What a trainer checks of a training batch before it trains on it: every group and
trajectory well formed (shapes, vocabulary, a bool loss mask, finite non-positive
logprobs of the trained tokens, finite rewards) and the rollout temperature usable.
Observation tokens (mask False) carry no logprob of the policy: theirs is not checked. A malformed batch is refused by name, never trained on.
"""

from __future__ import annotations

import math

import numpy as np

from trajectory_server.types import TrainingBatch

# engines compute logprobs in float32 or bfloat16; a hair above zero is rounding
LOGPROB_SLACK = 1e-3


class BatchError(ValueError):
    """A training batch the trainer cannot use; the message names the trajectory."""


def validate_batch(batch: TrainingBatch, vocab_size: int, *, allow_empty: bool = False) -> None:
    """Raise :class:`BatchError` naming the first malformed group or trajectory.

    ``allow_empty``: a data-parallel rank may get no groups of a small batch.
    """
    if not (math.isfinite(batch.temperature) and batch.temperature > 0):
        raise BatchError(
            f"the batch's temperature is {batch.temperature}; it must be the rollout's "
            "sampling temperature (> 0)"
        )
    if not allow_empty and (not batch.groups or not any(g.trajectories for g in batch.groups)):
        raise BatchError("the batch holds no trajectories")
    for group in batch.groups:
        prompt = np.asarray(group.prompt)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise BatchError(f"group {group.group_id}: the prompt must be a non-empty 1-D array")
        if prompt.min() < 0 or prompt.max() >= vocab_size:
            raise BatchError(
                f"group {group.group_id}: prompt ids outside the model's vocabulary "
                f"[0, {vocab_size})"
            )
        for t in group.trajectories:
            _validate_trajectory(t, f"trajectory {t.traj_id} (group {group.group_id})", vocab_size)


def _validate_trajectory(t: object, where: str, vocab_size: int) -> None:
    tokens = np.asarray(t.tokens)  # type: ignore[attr-defined]
    logprobs = np.asarray(t.logprobs)  # type: ignore[attr-defined]
    versions = np.asarray(t.versions)  # type: ignore[attr-defined]
    mask = np.asarray(t.mask)  # type: ignore[attr-defined]
    reward = t.reward  # type: ignore[attr-defined]
    if tokens.ndim != 1 or logprobs.ndim != 1 or versions.ndim != 1:
        raise BatchError(f"{where}: tokens, logprobs and versions must be 1-D")
    if not len(tokens) == len(logprobs) == len(versions):
        raise BatchError(
            f"{where}: {len(tokens)} tokens, {len(logprobs)} logprobs and "
            f"{len(versions)} versions; they must be of one length"
        )
    if len(tokens) == 0:
        raise BatchError(f"{where}: the response is empty")
    if mask.shape != tokens.shape or mask.dtype != np.bool_:
        raise BatchError(
            f"{where}: the loss mask must be a bool array of one entry per token, got "
            f"shape {mask.shape} dtype {mask.dtype}"
        )
    logprobs = np.where(mask, logprobs, 0.0)  # an observation's is a placeholder
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise BatchError(f"{where}: token ids outside the model's vocabulary [0, {vocab_size})")
    if not np.isfinite(logprobs).all():
        i = int(np.argmin(np.isfinite(logprobs)))
        raise BatchError(f"{where}: logprob {logprobs[i]} at position {i} is not finite")
    if logprobs.max() > LOGPROB_SLACK:
        i = int(np.argmax(logprobs))
        raise BatchError(
            f"{where}: logprob {logprobs[i]} at position {i} is positive; logprobs must be <= 0"
        )
    if not math.isfinite(reward):
        raise BatchError(f"{where}: reward {reward} is not finite")
