"""The GRPO / PPO loss pieces of the embedded trainer, as pure functions of tensors.

Notation, per response token ``t`` of a trajectory sampled by the rollout engine:

* ``π_behav(t)``: the behaviour policy, the logprob the engine recorded when it sampled
  the token. With asynchronous RL it may be several versions old, and even for the same
  weights the engine's numerics differ from the trainer's.
* ``π_prox(t)``: the proximal policy, the logprob recomputed with the trainer's weights
  before this update (AReaL's name; TIS calls the same quantity ``π_old``).
* ``π_θ(t)``: the policy being optimised, with gradients.
* ``A``: the trajectory's advantage, the same for all its tokens.

All functions work elementwise on tensors of any shape, with a mask of response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

OffPolicy = Literal["decoupled", "tis", "none"]
OFF_POLICY_MODES: tuple[str, ...] = ("decoupled", "tis", "none")
CapMode = Literal["truncate", "mask"]
CAP_MODES: tuple[str, ...] = ("auto", "truncate", "mask")
# What each correction does with a weight above the cap, as its authors do it: AReaL's
# decoupled PPO drops such tokens (``behav_imp_weight_cap`` masks them), TIS truncates
# the weight to the cap (Yao et al. 2025, eq. 3).
DEFAULT_CAP_MODE: dict[str, CapMode] = {"decoupled": "mask", "tis": "truncate"}


def resolve_cap_mode(off_policy: str, cap_mode: str) -> CapMode:
    """``cap_mode`` with ``"auto"`` resolved to the default of ``off_policy``."""
    if cap_mode not in CAP_MODES:
        raise ValueError(f"is_cap_mode={cap_mode!r}; use one of {CAP_MODES}")
    if cap_mode == "auto":
        return DEFAULT_CAP_MODE.get(off_policy, "truncate")
    return cap_mode  # type: ignore[return-value]


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages of GRPO, one per trajectory.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the trajectories of ``i``'s group
    ``g`` (Shao et al. 2024, "DeepSeekMath", §4.1.2), with the sample standard deviation
    (``n - 1`` in the denominator, as TRL and verl compute it). ``normalize_std=False``
    keeps ``r_i - mean_g(r)`` only, the unbiased variant of Dr. GRPO (Liu et al. 2025,
    "Understanding R1-Zero-Like Training"), selected by ``advantage="dapo"`` in the
    trainer. A group whose rewards are all equal (including a group of one) gets exactly
    zero: it says nothing about which response is better.

    rewards: float, shape ``(N,)``; group_index: int64, shape ``(N,)``, values ``0..G-1``.
    """
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must "
            "be 1-D and of one length"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.to(torch.float64)  # exact means for small groups of 0/1 rewards
    num_groups = int(group_index.max()) + 1
    counts = torch.bincount(group_index, minlength=num_groups).to(r.dtype)
    mean = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, group_index, r) / counts.clamp(
        min=1
    )
    centred = r - mean[group_index]
    if normalize_std:
        sq = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, group_index, centred**2)
        std = (sq / (counts - 1).clamp(min=1)).sqrt()
        centred = centred / (std[group_index] + eps)
    high = torch.full((num_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(
        0, group_index, r, "amax"
    )
    low = torch.full((num_groups,), torch.inf, dtype=r.dtype).scatter_reduce(
        0, group_index, r, "amin"
    )
    flat = (high == low)[group_index]
    return torch.where(flat, torch.zeros_like(centred), centred).to(rewards.dtype)


def token_level_loss(
    token_losses: torch.Tensor, mask: torch.Tensor, total_tokens: float | None = None
) -> torch.Tensor:
    """DAPO's token-level aggregation: ``sum(loss * mask) / total_tokens``.

    Every response token of the batch weighs the same, so long responses are not
    down-weighted as with a per-sequence mean (Yu et al. 2025, "DAPO", §3.3).
    ``total_tokens`` is the mask count of the whole batch; pass it when the batch is
    split into micro-batches so that their losses add up to the batch's.
    """
    denominator = float(mask.sum()) if total_tokens is None else float(total_tokens)
    return (token_losses * mask).sum() / max(denominator, 1.0)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss with DAPO's clip-higher.

    ``r = exp(logπ_θ - logπ_old)``, ``loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
    (Schulman et al. 2017; the decoupled bounds are DAPO's "clip-higher", §3.1, which
    leaves room for low-probability tokens to rise). Returns ``(loss, clipped)`` where
    ``clipped`` marks the tokens whose clipped term is the active one (no gradient).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_term = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped_term), clipped_term < unclipped


def behaviour_weights(
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    *,
    cap: float | None = None,
    cap_mode: CapMode = "truncate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights ``w = π_prox / π_behav`` correcting for the behaviour policy.

    ``cap`` bounds the variance: ``"truncate"`` uses ``min(w, cap)`` (truncated importance
    sampling, as TIS), ``"mask"`` sets ``w = 0`` where ``w > cap``, dropping those tokens
    (what AReaL's ``behav_imp_weight_cap`` does). Returns ``(w, capped)``; both carry no
    gradient.
    """
    weights = torch.exp(prox_logprobs.detach() - behav_logprobs.detach())
    if cap is None:
        return weights, torch.zeros_like(weights, dtype=torch.bool)
    capped = weights > cap
    if cap_mode == "truncate":
        return torch.clamp(weights, max=cap), capped
    if cap_mode == "mask":
        return torch.where(capped, torch.zeros_like(weights), weights), capped
    raise ValueError(f"cap_mode={cap_mode!r}; use 'truncate' or 'mask'")


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of ``KL(π_ref || π)`` from tokens sampled by ``π_ref``.

    Schulman's k3 estimator, ``(r - 1) - log r`` with ``r = π / π_ref``: unbiased and
    never negative ("Approximating KL Divergence", 2020). With ``ref`` the behaviour
    policy, it measures how far the trainer has moved from the policy that sampled.
    """
    log_ratio = (logprobs - ref_logprobs).detach()
    return torch.expm1(log_ratio) - log_ratio


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """The aggregated loss and its per-token parts (masked positions hold junk)."""

    loss: torch.Tensor  # scalar, with gradient
    token_losses: torch.Tensor
    ratio: torch.Tensor  # π_θ / π_old, the PPO ratio (no gradient)
    weights: torch.Tensor  # behaviour importance weights (ones for "none")
    clipped: torch.Tensor  # bool: the PPO clip is active
    capped: torch.Tensor  # bool: the importance weight exceeded the cap


def policy_loss(
    logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    off_policy: OffPolicy = "decoupled",
    prox_logprobs: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    is_cap: float | None = None,
    is_cap_mode: str = "auto",
    total_tokens: float | None = None,
) -> PolicyLoss:
    """The policy-gradient loss with an off-policy correction, aggregated per token.

    ``"decoupled"``: AReaL's decoupled PPO (Fu et al. 2025, "AReaL: A Large-Scale
    Asynchronous Reinforcement Learning System for Language Reasoning", §5.2; Hilton et
    al. 2022, "Batch size-invariance for policy optimization")::

        loss_t = -w_t · min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
        r_t = π_θ / π_prox,   w_t = π_prox / π_behav   (no gradient; capped if is_cap)

    The trust region is centred on the recent ``π_prox`` rather than on the stale
    behaviour policy, and ``w`` corrects the sampling distribution.

    ``"tis"``: truncated importance sampling (Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training")::

        loss_t = -min(π_old / π_behav, C) · min(r_t A, clip(r_t, ...) A),  r_t = π_θ / π_old

    with ``π_old`` the trainer's recomputed logprobs (``prox_logprobs`` here) and
    ``C = is_cap`` (truncation; 2 in the paper). It is the formula of ``"decoupled"``
    with the other treatment of large weights: TIS truncates them to ``C`` and keeps
    every token, decoupled PPO drops the tokens above the cap (``is_cap_mode="auto"``
    picks each one's own; :data:`DEFAULT_CAP_MODE`).

    ``"none"``: plain PPO with the behaviour logprobs as ``π_old`` (``r = π_θ / π_behav``,
    ``w = 1``): stale tokens are clipped, not reweighted.

    Aggregation: :func:`token_level_loss` with ``total_tokens``.
    """
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"off_policy={off_policy!r}; use one of {OFF_POLICY_MODES}")
    mask_f = mask.to(logprobs.dtype)
    if off_policy == "none":
        old = behav_logprobs
        weights = torch.ones_like(logprobs)
        capped = torch.zeros_like(logprobs, dtype=torch.bool)
    else:
        if prox_logprobs is None:
            raise ValueError(f"off_policy={off_policy!r} needs prox_logprobs")
        old = prox_logprobs.detach()
        mode = resolve_cap_mode(off_policy, is_cap_mode)
        weights, capped = behaviour_weights(old, behav_logprobs, cap=is_cap, cap_mode=mode)
    token_losses, clipped = ppo_clip_loss(
        logprobs, old, advantages, eps_low=eps_low, eps_high=eps_high
    )
    token_losses = weights * token_losses
    loss = token_level_loss(token_losses, mask_f, total_tokens)
    ratio = torch.exp(logprobs.detach() - old.detach())
    return PolicyLoss(loss, token_losses, ratio, weights, clipped, capped)
