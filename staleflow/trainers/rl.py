"""One RL training step, whatever the backend: batch → sequences → advantages → loss →
metrics.

The maths of a step exists here once; a backend only says how to get logits from token
ids, how to turn (scaled) logits into per-token logprobs and entropies, and how to apply
an update (:class:`StepBackend`). The embedded trainer's backend holds the whole model and
vocabulary in one process; a Megatron rank holds a slice of the vocabulary (tensor
parallel) and of the batch (data parallel), and reduces across its peers.

The step (``train_step``):

1. Check the batch (:func:`validate_batch`); group-relative advantages over each group's
   graded trajectories (:func:`build_sequences`). Groups are never split across data-
   parallel ranks, so advantages are local; counts and token totals are reduced.
2. Cut the batch into ``updates_per_step`` mini-batches (one optimizer update each); with
   more than one, the proximal policy is recomputed first (one no-grad pass).
3. Per micro-batch (the backend runs them: one after the other, or through a pipeline
   schedule, whose last stage computes the loss): logits → ``/ T`` (the rollout temperature that travels with the
   batch: the engines' logprobs are of ``softmax(logits / T)``) → logprobs and entropy →
   :func:`staleflow.trainers.losses.policy_loss` with the batch's total token count as the
   denominator → backward.
4. The backend reduces, clips and applies the gradients; metrics are summed, reduced and
   turned into means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Literal, Protocol, TypeVar

import numpy as np
import torch

from staleflow.config.sections import TrainerConfig
from staleflow.trainers.batch_checks import validate_batch
from staleflow.trainers.losses import approx_kl, group_advantages, policy_loss
from trajectory_server.types import TrainingBatch

ADV_EPS = 1e-6

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


# -- the batch --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class TrainSequence:
    """One trajectory ready for the model: ``prompt + response`` ids and, per response
    token, the behaviour logprob (and the proximal one, when computed apart)."""

    traj_id: int
    ids: np.ndarray  # prompt + response, int64
    prompt_len: int
    behav: np.ndarray  # float32 logprobs of the response tokens
    advantage: float
    prox: np.ndarray | None = None

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


# Batch statistics that add up across data-parallel ranks (and the two that take a max).
_BATCH_SUMS = (
    "reward_sum",
    "reward_sq_sum",
    "trajectories",
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

    def reduced(self, backend: StepBackend) -> BatchTally:
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
    shift its siblings' advantages.
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
        sequences.append(
            TrainSequence(
                traj_id=t.traj_id,
                ids=np.concatenate([prompt, tokens]),
                prompt_len=len(prompt),
                behav=np.minimum(np.asarray(t.logprobs, dtype=np.float32), 0.0),
                advantage=float(adv),
            )
        )
        stale = version - np.asarray(t.versions, dtype=np.float64)
        s, m = tally.sums, tally.maxes
        s["response_len_sum"] += len(tokens)
        m["response_len_max"] = max(m["response_len_max"], float(len(tokens)))
        s["staleness_sum"] += float(stale.sum())
        s["staleness_tokens"] += len(stale)
        m["token_staleness_max"] = max(m["token_staleness_max"], float(stale.max()))
    by_group: dict[int, set[float]] = {}
    for g, r in zip(group_index, rewards, strict=True):
        by_group.setdefault(g, set()).add(r)
    s = tally.sums
    s["trajectories"] = float(len(sequences))
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
    """Right-padded ids and, aligned with the next-token logits (width - 1), the response
    mask, targets, behaviour logprobs, advantages and (when given) proximal logprobs."""

    ids: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    prox: torch.Tensor | None

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
    for i, s in enumerate(chunk):
        ids[i, : len(s.ids)] = s.ids
        span = _response_span(s)  # the logits at position t predict token t + 1
        mask[i, span] = True
        behav[i, span] = s.behav
        adv[i, span] = s.advantage
        if s.prox is not None:
            prox[i, span] = s.prox
    has_prox = chunk[0].prox is not None
    return MicroBatch(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.from_numpy(behav),
        torch.from_numpy(adv),
        torch.from_numpy(prox) if has_prox else None,
    )


def _response_span(s: TrainSequence) -> slice:
    return slice(s.prompt_len - 1, len(s.ids) - 1)


# -- scoring and the loss ------------------------------------------------------------------


def score(
    backend: StepBackend, mb: MicroBatch, logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (with gradient) and entropies of the response tokens of ``mb`` from its
    ``logits``, under the policy at ``temperature``: ``log_softmax(logits / T)``, the
    distribution the engines sampled from and recorded. Only response positions reach the
    softmax."""
    scaled = logits[:, :-1][mb.mask].float() / temperature
    return backend.token_stats(scaled, mb.targets[mb.mask])


_LOSS_SUMS = (
    "loss",
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

    ``total_tokens`` is the response-token count of the whole (global) mini-batch: the
    micro-batches' losses then add up to DAPO's token-level mean over it.
    """
    logprobs, entropy = score(backend, mb, logits, temperature)
    behav, adv = mb.behav[mb.mask], mb.adv[mb.mask]
    out = policy_loss(
        logprobs,
        behav,
        adv,
        torch.ones_like(logprobs),
        off_policy=settings.off_policy,  # type: ignore[arg-type]
        prox_logprobs=mb.prox[mb.mask] if mb.prox is not None else logprobs.detach(),
        eps_low=settings.eps_low,
        eps_high=settings.eps_high,
        is_cap=settings.is_cap,
        is_cap_mode=settings.is_cap_mode,
        total_tokens=total_tokens,
    )
    with torch.no_grad():
        s = tally.sums
        s["loss"] += out.loss.item()
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
    return out.loss


def with_prox(
    backend: StepBackend,
    sequences: Sequence[TrainSequence],
    settings: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
) -> list[TrainSequence]:
    """Attach the current weights' logprobs (the proximal policy) to each sequence."""
    chunks = list(micro_batches(sequences, settings.micro_batch_tokens, settings.micro_batch_size))
    mbs = [pad(chunk, pad_id) for chunk in chunks]
    prox: dict[int, np.ndarray] = {}

    def collect(i: int, logits: torch.Tensor) -> None:
        logprobs, _ = score(backend, mbs[i], logits, temperature)
        flat = logprobs.float().cpu().numpy()
        at = 0
        for s in chunks[i]:  # mask order is row-major: sequence by sequence
            prox[s.traj_id] = flat[at : at + s.response_len].copy()
            at += s.response_len

    if mbs:
        backend.forward_backward(mbs, collect, forward_only=True)
    prox = backend.from_last_stage(prox)
    return [replace(s, prox=prox[s.traj_id]) for s in sequences]


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
    local = float(sum(s.response_len for s in part))
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
) -> tuple[dict[str, float], list[float]]:
    """One training step of ``backend`` on ``batch`` (this rank's part of it).

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
    everyone = int(batch_tally.sums["trajectories"])
    tally = LossTally()
    norms: list[float] = []
    if everyone:  # every reward failed: no update at all, on every rank alike
        parts = min(settings.updates_per_step, everyone)
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
    return {
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
