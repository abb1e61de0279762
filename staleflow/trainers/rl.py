"""One RL training step, whatever the backend: batch → sequences → advantages → loss →
metrics.

The maths of a step exists here once; a backend only says how to get logits from token
ids, how to turn (scaled) logits into per-token logprobs and entropies, and how to apply
an update (:class:`StepBackend`). The embedded trainer's backend holds the whole model and
vocabulary in one process; a Megatron rank holds a slice of the vocabulary (tensor
parallel) and of the batch (data parallel), and reduces across its peers.

The step (``train_step``):

1. Check the batch (:func:`validate_batch`); group-relative advantages over each group's
   graded trajectories (:func:`staleflow.trainers.sequences.build_sequences`). Groups
   are never split across data-parallel ranks, so advantages are local; counts and
   token totals are reduced.
2. With a reference policy (``trainer.kl_coef > 0``, ``trainer.ref``), its logprobs of
   every trained token (one no-grad pass of the frozen reference,
   :func:`with_reference`). Cut the batch into ``updates_per_step`` mini-batches (one
   optimizer update each); with more than one, the proximal policy is recomputed first
   (one no-grad pass).
3. Per micro-batch (the backend runs them: one after the other, or through a pipeline
   schedule, whose last stage computes the loss): logits → ``/ T`` (the rollout temperature that travels with the
   batch: the engines' logprobs are of ``softmax(logits / T)``) → logprobs and entropy →
   :func:`staleflow.trainers.losses.policy_loss` (``trainer.loss``, aggregated by
   ``trainer.loss_agg`` with the whole mini-batch's token or sequence count as the
   denominator) plus ``kl_coef`` times the aggregated KL to the reference → backward.
4. The backend reduces, clips and applies the gradients; metrics are summed, reduced and
   turned into means.

The loss mask: a multi-turn response holds model turns and environment observations
(``trajectory_server.types``). Observation tokens are context only: they are in the
ids the model reads, but never scored — they reach no softmax, no loss, no importance
weight or clip, no token count (the denominator is the number of *trained* tokens) and
no per-token statistic. A trajectory with no trained token still counts in its group's
advantages (its reward is real) but adds nothing to the loss; a batch with none at all
takes no update, like a batch whose every reward failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, TypeVar

import numpy as np
import torch

from staleflow.config.sections import TrainerConfig
from staleflow.trainers.batch_checks import validate_batch
from staleflow.trainers.interface import REFERENCE_METRIC_KEYS
from staleflow.trainers.losses import (
    aggregate,
    approx_kl,
    kl_penalty,
    loss_units,
    policy_loss,
)
from staleflow.trainers.sequences import (
    BatchTally,
    MicroBatch,
    TrainSequence,
    build_sequences,
    micro_batches,
    mini_batches,
    pad,
)
from trajectory_server.types import TrainingBatch

ReduceOp = Literal["sum", "max", "min"]
_T = TypeVar("_T")


MicroFn = Callable[[int, torch.Tensor], "torch.Tensor | None"]


class StepBackend(Protocol):
    """What a trainer backend provides to :func:`train_step`.

    ``forward_backward`` runs the model on each micro-batch of ``mbs`` and calls
    ``fn(i, logits)`` with micro-batch ``i``'s logits, ``[batch, seq, vocab or vocab / tp]``
    (with gradient unless ``forward_only``), where the logits exist: on every rank of a
    single-stage model, on the last pipeline stage of a pipelined one. ``fn`` returns the
    micro-batch's loss, which the backend backpropagates (unless ``forward_only``).
    ``from_last_stage`` hands a value computed there (in ``fn``) to every rank of the
    pipeline. ``token_stats`` turns already temperature-scaled logits of ``n`` positions
    into their targets' logprobs (with gradient) and the entropies (without). ``update``
    applies the accumulated gradients (reduce, clip, optimizer step) and returns the global
    gradient norm before clipping, NaN when the update was skipped for a non-finite norm.
    ``reduce`` combines per-rank numbers over the data-parallel ranks (identity in one
    process).
    """

    vocab_size: int

    def forward_backward(
        self, mbs: Sequence[MicroBatch], fn: MicroFn, *, forward_only: bool
    ) -> None: ...

    def from_last_stage(self, value: _T) -> _T: ...

    def token_stats(
        self, scaled_logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def zero_grad(self) -> None: ...

    def update(self) -> float: ...

    def reduce(self, values: np.ndarray, op: ReduceOp) -> np.ndarray: ...


class LocalReduce:
    """``StepBackend.reduce`` of a single process: nothing to combine."""

    @staticmethod
    def reduce(values: np.ndarray, op: ReduceOp) -> np.ndarray:
        return values


class SingleStage:
    """``StepBackend.forward_backward`` and ``from_last_stage`` of a backend whose every
    rank holds all the layers: ``logits(ids)`` per micro-batch, then backward."""

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_backward(
        self, mbs: Sequence[MicroBatch], fn: MicroFn, *, forward_only: bool
    ) -> None:
        for i, mb in enumerate(mbs):
            with torch.no_grad() if forward_only else nullcontext():
                loss = fn(i, self.logits(mb.ids))
            if not forward_only and loss is not None:
                loss.backward()

    @staticmethod
    def from_last_stage(value: _T) -> _T:
        return value


def dense_token_stats(
    scaled_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` and entropies under the full-vocabulary softmax."""
    log_probs = torch.log_softmax(scaled_logits, dim=-1)
    logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def adamw(params: list[torch.nn.Parameter], settings: TrainerConfig) -> torch.optim.AdamW:
    """The AdamW of the ``trainer`` section (the embedded trainer's, and Megatron's on CPU)."""
    return torch.optim.AdamW(
        params,
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        weight_decay=settings.weight_decay,
        foreach=True,
    )


# -- scoring and the loss ------------------------------------------------------------------


def score(
    backend: StepBackend, mb: MicroBatch, logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (with gradient) and entropies of the response tokens of ``mb`` from its
    ``logits``, under the policy at ``temperature``: ``log_softmax(logits / T)``, the
    distribution the engines sampled from and recorded. Only trained positions (the
    model's response tokens) reach the softmax."""
    scaled = logits[:, :-1][mb.mask].float() / temperature
    return backend.token_stats(scaled, mb.targets[mb.mask])


_LOSS_SUMS = (
    "loss",
    "kl_loss",
    "ref_kl",
    "ref_tokens",
    "clipped",
    "weight",
    "capped",
    "corrected",
    "ratio",
    "entropy",
    "kl",
    "tokens",
)


@dataclass(slots=True)
class LossTally:
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_LOSS_SUMS, 0.0))
    weight_min: float = math.inf
    weight_max: float = -math.inf


def norm_len(settings: TrainerConfig) -> float | None:
    """The constant length of ``loss_agg=seq_mean_token_sum_norm`` (Dr. GRPO)."""
    if settings.aggregation(settings.advantage) != "seq_mean_token_sum_norm":
        return None
    if settings.loss_norm_len <= 0:
        raise ValueError(
            "trainer.loss_agg=seq_mean_token_sum_norm (Dr. GRPO) divides by a constant "
            "length: set trainer.loss_norm_len (RunConfig.resolved() sets it to "
            "rollout.max_response_tokens)"
        )
    return float(settings.loss_norm_len)


def batch_units(settings: TrainerConfig, sequences: Sequence[TrainSequence]) -> float:
    """What the loss of ``sequences`` is divided by: their trained tokens, or their number
    for the per-sequence aggregations (:func:`staleflow.trainers.losses.loss_units`)."""
    return loss_units(settings.aggregation(settings.advantage), [s.trained for s in sequences])


def micro_loss(
    backend: StepBackend,
    mb: MicroBatch,
    logits: torch.Tensor,
    settings: TrainerConfig,
    *,
    temperature: float,
    total_tokens: float,
    tally: LossTally,
) -> torch.Tensor:
    """The loss of one micro-batch from its ``logits``; adds its statistics to ``tally``.

    ``total_tokens`` is the denominator of the whole (global) mini-batch
    (:func:`batch_units`: its trained tokens, or its sequences for a per-sequence
    ``trainer.loss_agg``): the micro-batches' losses then add up to the mini-batch's.
    Every tensor here holds the trained positions only (``mb.mask``), so the off-policy
    correction, the clip, the sequence ratios of GSPO, the KL and every statistic see the
    model's tokens alone; ``rows`` says which sequence each one is of.
    """
    logprobs, entropy = score(backend, mb, logits, temperature)
    behav, adv = mb.behav[mb.mask], mb.adv[mb.mask]
    rows = mb.mask.nonzero(as_tuple=True)[0]
    agg = settings.aggregation(settings.advantage)
    length = norm_len(settings)
    out = policy_loss(
        logprobs,
        behav,
        adv,
        torch.ones_like(logprobs, dtype=torch.bool),
        loss=settings.loss,
        off_policy=settings.off_policy,  # type: ignore[arg-type]
        prox_logprobs=mb.prox[mb.mask] if mb.prox is not None else logprobs.detach(),
        eps_low=settings.eps_low,
        eps_high=settings.eps_high,
        is_cap=settings.is_cap,
        is_cap_mode=settings.is_cap_mode,
        aggregation=agg,
        denominator=total_tokens,
        rows=rows,
        norm_len=length,
    )
    loss = out.loss
    s = tally.sums
    if mb.ref is not None:
        ref = mb.ref[mb.mask]
        if settings.kl_coef > 0:
            kl = kl_penalty(logprobs, ref, settings.kl_estimator)
            keep = torch.ones_like(kl, dtype=torch.bool)
            term = settings.kl_coef * aggregate(
                kl, keep, rows, agg, denominator=total_tokens, norm_len=length
            )
            loss = loss + term
            s["kl_loss"] += term.item()
        with torch.no_grad():  # reported with k3 whatever the estimator: unbiased, >= 0
            s["ref_kl"] += float(kl_penalty(logprobs.detach(), ref, "k3").sum())
            s["ref_tokens"] += float(logprobs.numel())
    with torch.no_grad():
        s["loss"] += loss.item()
        s["clipped"] += float(out.clipped.sum())
        s["weight"] += float(out.weights.sum())
        s["capped"] += float(out.capped.sum())
        # what the off-policy correction took out of the gradient, either way: the staler
        # the data, the more of it (coordinator/freshness.py; docs/staleness.md)
        s["corrected"] += float((out.clipped | out.capped).sum())
        s["ratio"] += float(out.ratio.sum())
        s["entropy"] += float(entropy.sum())
        s["kl"] += float(approx_kl(logprobs, behav).sum())
        s["tokens"] += float(logprobs.numel())
        if logprobs.numel():
            tally.weight_min = min(tally.weight_min, float(out.weights.min()))
            tally.weight_max = max(tally.weight_max, float(out.weights.max()))
    return loss


def _logprobs_of(
    backend: StepBackend,
    sequences: Sequence[TrainSequence],
    settings: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
) -> dict[int, np.ndarray]:
    """``backend``'s logprobs of each sequence's trained tokens (a no-grad pass), by
    trajectory id, as full response-length arrays (observations hold 0, never read)."""
    chunks = list(micro_batches(sequences, settings.micro_batch_tokens, settings.micro_batch_size))
    mbs = [pad(chunk, pad_id) for chunk in chunks]
    out: dict[int, np.ndarray] = {}

    def collect(i: int, logits: torch.Tensor) -> None:
        logprobs, _ = score(backend, mbs[i], logits, temperature)
        flat = logprobs.float().cpu().numpy()
        at = 0
        for s in chunks[i]:  # mask order is row-major: sequence by sequence
            full = np.zeros(s.response_len, dtype=np.float32)  # observations: never read
            full[s.mask] = flat[at : at + s.trained]
            out[s.traj_id] = full
            at += s.trained

    if mbs:
        backend.forward_backward(mbs, collect, forward_only=True)
    return backend.from_last_stage(out)


def with_prox(
    backend: StepBackend,
    sequences: Sequence[TrainSequence],
    settings: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
) -> list[TrainSequence]:
    """Attach the current weights' logprobs (the proximal policy) to each sequence."""
    prox = _logprobs_of(backend, sequences, settings, pad_id=pad_id, temperature=temperature)
    return [replace(s, prox=prox[s.traj_id]) for s in sequences]


def with_reference(
    reference: StepBackend | None,
    sequences: Sequence[TrainSequence],
    settings: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
) -> list[TrainSequence]:
    """Attach the frozen reference policy's logprobs to each sequence (for the KL term
    and ``train/ref_kl``); the sequences as they are without a reference. The reference
    is scored at the batch's temperature, like the policy: the KL is between the two
    sampling distributions."""
    if reference is None or not sequences:
        return list(sequences)
    ref = _logprobs_of(reference, sequences, settings, pad_id=pad_id, temperature=temperature)
    return [replace(s, ref=ref[s.traj_id]) for s in sequences]


def _update(
    backend: StepBackend,
    part: Sequence[TrainSequence],
    settings: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
    tally: LossTally,
) -> float:
    """One optimizer update on ``part`` (this rank's share of one mini-batch)."""
    local = batch_units(settings, part)
    total = float(backend.reduce(np.array([local]), "sum")[0])
    backend.zero_grad()
    accumulate(
        backend,
        part,
        settings,
        pad_id=pad_id,
        temperature=temperature,
        total_tokens=total,
        tally=tally,
    )
    return backend.update()


def accumulate(
    backend: StepBackend,
    sequences: Sequence[TrainSequence],
    settings: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
    total_tokens: float,
    tally: LossTally,
) -> None:
    """Forward/backward of ``sequences`` in micro-batches: their losses (over
    ``total_tokens``, see :func:`micro_loss`) add to the gradients."""
    mbs = [
        pad(chunk, pad_id)
        for chunk in micro_batches(
            sequences, settings.micro_batch_tokens, settings.micro_batch_size
        )
    ]

    def loss(i: int, logits: torch.Tensor) -> torch.Tensor:
        return micro_loss(
            backend,
            mbs[i],
            logits,
            settings,
            temperature=temperature,
            total_tokens=total_tokens,
            tally=tally,
        )

    if mbs:  # a data-parallel rank may have no share of this mini-batch
        backend.forward_backward(mbs, loss, forward_only=False)


def train_step(
    backend: StepBackend,
    batch: TrainingBatch,
    settings: TrainerConfig,
    *,
    version: int,
    pad_id: int,
    allow_empty: bool = False,
    reference: StepBackend | None = None,
) -> tuple[dict[str, float], list[float]]:
    """One training step of ``backend`` on ``batch`` (this rank's part of it);
    ``reference`` scores the frozen reference policy (None: no KL term).

    Returns the step's metrics (reduced over the data-parallel ranks: every rank gets the
    same numbers) and the gradient norm of each update. The caller seeds the RNG and
    bumps the version. With ``updates_per_step == 1`` the proximal policy is the weights
    of this step's own forward passes: ``π_prox`` is their logprobs, detached, and no
    extra pass is needed (the PPO ratio is then 1 at the update and the clip bites only
    in ``off_policy="none"``, against the behaviour policy).
    """
    validate_batch(batch, backend.vocab_size, allow_empty=allow_empty)
    sequences, local_tally = build_sequences(batch, settings.advantage, version)
    batch_tally = local_tally.reduced(backend)
    everyone = int(batch_tally.sums["trained_trajectories"])
    tally = LossTally()
    norms: list[float] = []
    # none: every reward failed, or no token to train; no update at all, on every rank alike
    if everyone:
        parts = min(settings.updates_per_step, everyone)
        sequences = with_reference(
            reference, sequences, settings, pad_id=pad_id, temperature=batch.temperature
        )
        if parts > 1:
            sequences = with_prox(
                backend, sequences, settings, pad_id=pad_id, temperature=batch.temperature
            )
        for part in mini_batches(sequences, parts):
            norms.append(
                _update(
                    backend,
                    part,
                    settings,
                    pad_id=pad_id,
                    temperature=batch.temperature,
                    tally=tally,
                )
            )
    # the loss is computed (and tallied) on the last pipeline stage only
    tally = backend.from_last_stage(tally)
    return step_metrics(backend, batch_tally, tally, norms), norms


def step_metrics(
    backend: StepBackend, batch_tally: BatchTally, tally: LossTally, norms: list[float]
) -> dict[str, float]:
    sums = dict(
        zip(
            _LOSS_SUMS,
            backend.reduce(np.array([tally.sums[k] for k in _LOSS_SUMS]), "sum").tolist(),
            strict=True,
        )
    )
    w_min = float(backend.reduce(np.array([tally.weight_min]), "min")[0])
    w_max = float(backend.reduce(np.array([tally.weight_max]), "max")[0])
    n = max(sums["tokens"], 1.0)
    finite = bool(norms) and all(math.isfinite(g) for g in norms)
    nan = float("nan")
    reference = {}
    if sums["ref_tokens"]:  # only with a reference: no number where none was measured
        ref_kl, kl_loss = REFERENCE_METRIC_KEYS
        reference = {ref_kl: sums["ref_kl"] / sums["ref_tokens"], kl_loss: sums["kl_loss"]}
    return {
        **reference,
        **batch_tally.metrics(),
        "train/loss": sums["loss"],
        # no update at all (every reward failed): a NaN norm, 0 updates, same weights
        "train/grad_norm": float(np.mean(norms)) if finite else nan,
        "train/clip_frac": sums["clipped"] / n,
        "train/importance_weight_mean": sums["weight"] / n,
        "train/importance_weight_min": w_min if math.isfinite(w_min) else nan,
        "train/importance_weight_max": w_max if math.isfinite(w_max) else nan,
        "train/is_capped_frac": sums["capped"] / n,
        "train/corrected_frac": sums["corrected"] / n,
        "train/ratio_mean": sums["ratio"] / n,
        "train/entropy": sums["entropy"] / n,
        "train/kl_behav": sums["kl"] / n,
        "train/tokens": sums["tokens"],
        "train/skipped": float(sum(not math.isfinite(g) for g in norms)),
        "train/updates": float(len(norms)),
    }
