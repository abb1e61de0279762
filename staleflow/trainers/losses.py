"""The RL loss maths of both trainers (embedded and Megatron), as pure functions of
tensors: advantages, the policy losses (PPO, GSPO, CISPO), their aggregation, the
off-policy correction for stale data and the KL to a reference policy.

Notation, per response token ``t`` of a trajectory sampled by the rollout engine:

* ``π_behav(t)``: the behaviour policy, the logprob the engine recorded when it sampled
  the token. With asynchronous RL it may be several versions old, and even for the same
  weights the engine's numerics differ from the trainer's.
* ``π_prox(t)``: the proximal policy, the logprob recomputed with the trainer's weights
  before this update (AReaL's name; TIS calls the same quantity ``π_old``).
* ``π_θ(t)``: the policy being optimised, with gradients.
* ``A``: the trajectory's advantage, the same for all its tokens.

* ``π_ref(t)``: a frozen reference policy (the initial one by default), for the KL term.

All functions work elementwise on tensors of any shape, with a mask of response tokens;
the sequence-level ones (GSPO, the per-sequence aggregations) also take ``rows``, the
sequence of each element. docs/training.md has the formulas side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Loss = Literal["ppo", "gspo", "cispo"]
LOSSES: tuple[str, ...] = ("ppo", "gspo", "cispo")
Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
AGGREGATIONS: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
# exp() of a log-ratio beyond this overflows float32 soon after; clamped as verl does in
# its k3 so that one wild token cannot make the loss infinite
_KL_LOG_RATIO_CLAMP = 20.0
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
    "Understanding R1-Zero-Like Training"), selected by ``advantage="dapo"`` (and
    ``"drgrpo"``, which adds its constant length normalisation) in the
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


def rows_of(values: torch.Tensor) -> torch.Tensor:
    """The default ``rows`` of ``values``: its first index for a 2-D (sequences x tokens)
    tensor, one sequence for a 1-D one."""
    if values.ndim >= 2:
        index = torch.arange(values.shape[0], device=values.device)
        return index.view(-1, *([1] * (values.ndim - 1))).expand_as(values)
    return torch.zeros(values.shape, dtype=torch.long, device=values.device)


def _per_row(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, rows, values)


def aggregate(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor,
    mode: str = "token_mean",
    *,
    denominator: float | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """The loss of a (micro-)batch from its per-token losses (1-D, with ``mask`` bool and
    ``rows`` the sequence of each token); masked tokens contribute nothing.

    ``token_mean``: ``Σ_i Σ_t l / Σ_i |y_i|`` (DAPO, every token weighs the same);
    ``seq_mean_token_mean``: ``(1/G) Σ_i (1/|y_i|) Σ_t l`` (GRPO's and GSPO's);
    ``seq_mean_token_sum``: ``(1/G) Σ_i Σ_t l``;
    ``seq_mean_token_sum_norm``: ``(1/G) Σ_i Σ_t l / L`` with ``L = norm_len`` a
    constant (Dr. GRPO: the longest response allowed, so no length bias either way).
    ``|y_i|`` counts the trained tokens of sequence ``i`` (all of them are in one
    micro-batch). ``denominator`` replaces the local count (tokens for ``token_mean``,
    sequences otherwise) by the whole batch's (:func:`loss_units`), so that micro-batch
    losses add up to the batch's.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss_agg={mode!r}; use one of {AGGREGATIONS}")
    kept = torch.where(mask, token_losses, torch.zeros_like(token_losses))
    if mode == "token_mean":
        local = float(mask.sum())
        total = kept.sum()
    else:
        n = int(rows.max()) + 1 if rows.numel() else 0
        counts = _per_row(mask.to(kept.dtype), rows, n)
        sums = _per_row(kept, rows, n)
        local = float((counts > 0).sum())
        if mode == "seq_mean_token_mean":
            total = (sums / counts.clamp(min=1.0)).sum()
        elif mode == "seq_mean_token_sum":
            total = sums.sum()
        else:
            if norm_len is None or norm_len <= 0:
                raise ValueError("loss_agg=seq_mean_token_sum_norm needs norm_len > 0")
            total = sums.sum() / float(norm_len)
    den = local if denominator is None else float(denominator)
    return total / max(den, 1.0)


def loss_units(mode: str, trained: list[int]) -> float:
    """What :func:`aggregate` divides by for sequences of ``trained`` tokens each: their
    token count for ``token_mean``, the number of sequences (with a trained token)
    otherwise."""
    if mode == "token_mean":
        return float(sum(trained))
    return float(sum(1 for n in trained if n > 0))


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
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * advantages
    clipped_term = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped_term), clipped_term < unclipped


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token GSPO loss (Zheng et al. 2025, "Group Sequence Policy Optimization").

    The sequence ratio ``s_i = exp((1/|y_i|) Σ_t (logπ_θ - logπ_old))`` over the trained
    tokens of sequence ``i`` is clipped as a whole: ``-min(s_i A, clip(s_i, 1 - eps_low,
    1 + eps_high) A)``. Written per token in the paper's GSPO-token form (eq. 13), with
    ``s_{i,t} = sg[s_i] · π_θ(t) / sg[π_θ(t)]``: the value is ``s_i`` on every token of the
    sequence, and the gradient of the sequence mean of token means is GSPO's
    ``s_i A (1/|y_i|) Σ_t ∇logπ_θ(t)``; a per-token behaviour weight then weighs its own
    token's gradient. Returns ``(loss, clipped, s)`` per token.
    """
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    n = int(rows.max()) + 1 if rows.numel() else 0
    counts = _per_row(mask.to(logprobs.dtype), rows, n).clamp(min=1.0)
    seq_log = (_per_row(log_ratio.detach(), rows, n) / counts)[rows]
    ratio = torch.exp(seq_log + logprobs - logprobs.detach())
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_low, eps_high)
    return loss, clipped, ratio.detach()


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss (MiniMax 2025, "MiniMax-M1", §3.1, eq. 4):
    ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) · A · logπ_θ`` with ``r = π_θ / π_old``.

    The importance weight is clipped, never the token: every token keeps a gradient
    (``A ∇logπ_θ`` scaled by the clipped weight), where PPO's clip zeroes it. Returns
    ``(loss, clipped)``, ``clipped`` where the weight was clipped.
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * logprobs, weight != ratio


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


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ || π_ref)``, with gradient through ``logprobs``,
    from tokens sampled by (about) ``π_θ`` (Schulman, "Approximating KL Divergence", 2020),
    with ``log q = logπ_ref - logπ_θ``:

    * ``k1 = -log q``: unbiased, high variance, can be negative; as a loss its expected
      gradient is zero (it only pushes through the sampled tokens' logprobs);
    * ``k2 = ½ (log q)²``: biased but low variance; its gradient is the true gradient of
      the KL (on-policy);
    * ``k3 = (q - 1) - log q``: unbiased, never negative, low variance (GRPO's,
      DeepSeekMath eq. 4).

    ``log q`` is clamped to ±20 (no gradient beyond): one wild token must not make the
    loss infinite.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r}; use one of {KL_ESTIMATORS}")
    log_rho = (ref_logprobs.detach() - logprobs).clamp(-_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    return torch.expm1(log_rho) - log_rho


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """The aggregated loss and its per-token parts (masked positions hold junk)."""

    loss: torch.Tensor  # scalar, with gradient
    token_losses: torch.Tensor
    ratio: torch.Tensor  # π_θ / π_old, the PPO ratio (GSPO: the sequence's; no gradient)
    weights: torch.Tensor  # behaviour importance weights (ones for "none")
    clipped: torch.Tensor  # bool: the clip is active (CISPO: the weight was clipped)
    capped: torch.Tensor  # bool: the importance weight exceeded the cap


def policy_loss(
    logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss: str = "ppo",
    off_policy: OffPolicy = "decoupled",
    prox_logprobs: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    is_cap: float | None = None,
    is_cap_mode: str = "auto",
    aggregation: str = "token_mean",
    denominator: float | None = None,
    rows: torch.Tensor | None = None,
    norm_len: float | None = None,
) -> PolicyLoss:
    """The policy-gradient loss ``loss`` with an off-policy correction, aggregated.

    The variants (``loss``), with ``π_old`` the policy the correction names below:

    * ``"ppo"``: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``r = π_θ / π_old``
      per token (:func:`ppo_clip_loss`);
    * ``"gspo"``: the same with the sequence's length-normalised ratio, clipped per
      sequence (:func:`gspo_loss`);
    * ``"cispo"``: ``-sg(clip(r, ...)) A logπ_θ`` per token (:func:`cispo_loss`).

    The off-policy correction (``off_policy``) chooses ``π_old`` and a per-token weight
    ``w`` (no gradient) that multiplies every variant's token loss alike:

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

    ``"none"``: the behaviour logprobs are ``π_old`` (``r = π_θ / π_behav``, ``w = 1``):
    stale tokens are clipped, not reweighted (for CISPO this is MiniMax-M1's own form).

    Aggregation: :func:`aggregate` (``aggregation``, ``denominator``, ``norm_len``) over
    the tokens where ``mask`` is set; ``rows`` gives each element's sequence (default:
    :func:`rows_of`). Masked elements reach neither the loss, nor a GSPO sequence ratio.
    """
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"off_policy={off_policy!r}; use one of {OFF_POLICY_MODES}")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}; use one of {LOSSES}")
    keep = mask.bool()
    rows = rows_of(logprobs) if rows is None else rows
    if off_policy == "none":
        old = behav_logprobs.detach()
        weights = torch.ones_like(logprobs)
        capped = torch.zeros_like(logprobs, dtype=torch.bool)
    else:
        if prox_logprobs is None:
            raise ValueError(f"off_policy={off_policy!r} needs prox_logprobs")
        old = prox_logprobs.detach()
        mode = resolve_cap_mode(off_policy, is_cap_mode)
        weights, capped = behaviour_weights(old, behav_logprobs, cap=is_cap, cap_mode=mode)
    ratio = torch.exp(logprobs.detach() - old)
    if loss == "gspo":
        flat = [t.reshape(-1) for t in (logprobs, old, advantages, keep, rows)]
        token_losses, clipped, ratio = gspo_loss(
            *flat[:4], flat[4], eps_low=eps_low, eps_high=eps_high
        )
        token_losses, clipped = token_losses.view_as(logprobs), clipped.view_as(logprobs)
        ratio = ratio.view_as(logprobs)
    elif loss == "cispo":
        token_losses, clipped = cispo_loss(
            logprobs, old, advantages, eps_low=eps_low, eps_high=eps_high
        )
    else:
        token_losses, clipped = ppo_clip_loss(
            logprobs, old, advantages, eps_low=eps_low, eps_high=eps_high
        )
    token_losses = weights * token_losses
    total = aggregate(
        token_losses.reshape(-1),
        keep.reshape(-1),
        rows.reshape(-1),
        aggregation,
        denominator=denominator,
        norm_len=norm_len,
    )
    return PolicyLoss(total, token_losses, ratio, weights, clipped, capped)
