"""The embedded trainer: GRPO with an off-policy correction, in PyTorch, in-process.

Meant for small models on CPU (the built-in task) and for tests of the asynchronous
pipeline; large models go to a Megatron backend. Each :meth:`EmbeddedTrainer.train_step`
turns one :class:`~trajectory_server.types.TrainingBatch` into right-padded
``prompt + response`` sequences, accumulates the loss of :mod:`staleflow.trainers.losses`
over micro-batches, and takes one AdamW step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from parameter_server.torch_compat import to_numpy
from staleflow.models.state import load_policy_state, policy_state
from staleflow.trainers.losses import (
    CAP_MODES,
    OFF_POLICY_MODES,
    approx_kl,
    group_advantages,
    policy_loss,
)
from trajectory_server.types import TrainingBatch

if TYPE_CHECKING:
    from staleflow.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ADVANTAGES = ("grpo", "dapo")
_STATE_FILE = "trainer_state.json"
_OPTIMIZER_FILE = "optimizer.pt"
_RNG_FILE = "rng.pt"  # torch's generators (a step seeds its own from seed and version)
# engines compute logprobs in float32 or bfloat16; a hair above zero is rounding
_LOGPROB_SLACK = 1e-3


class BatchError(ValueError):
    """A training batch the trainer cannot use; the message names the trajectory."""


@dataclass(slots=True)
class EmbeddedTrainerConfig:
    """Optimizer and loss settings of :class:`EmbeddedTrainer`.

    lr, betas, weight_decay: AdamW. The default lr is measured on the warmed "tiny"
        policy with batches of 16 groups of 8: 3e-5 raised sampled accuracy from 41% to
        46% in 300 on-policy steps, 1e-4 made no progress in 150, and 3e-4 collapsed the
        policy to ~0% within 50 (Adam turns the noise of small policy-gradient batches
        into full-size steps).
    max_grad_norm: global gradient-norm clip.
    eps_low, eps_high: PPO clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher).
    off_policy: "decoupled" | "tis" | "none" (see :func:`staleflow.trainers.losses.policy_loss`).
    is_cap: cap of the behaviour importance weight ``π_prox / π_behav``; None: no cap.
    is_cap_mode: "truncate" (``min(w, cap)``), "mask" (drop tokens above the cap) or
        "auto": mask for "decoupled" (as AReaL), truncate for "tis" (as Yao et al.).
    advantage: "grpo" (``(r - mean) / (std + eps)``) or "dapo" (``r - mean``).
    micro_batch_tokens: padded tokens per forward/backward pass (bounds memory; a
        sequence longer than this gets a micro-batch of its own).
    micro_batch_size: optionally, at most this many sequences per micro-batch.
    updates_per_step: optimizer updates per training step (PPO mini-batches, verl's
        ``ppo_mini_batch_size``): the batch is cut into this many mini-batches, each one
        AdamW update. With more than one, the proximal policy of the decoupled correction
        is the weights before the first update (one extra forward pass), so the PPO clip
        bounds how far the later updates move from it.
    seed: seeds the torch RNG around each step (from ``seed`` and the version), so a
        model with stochastic layers trains reproducibly without touching global state.
    num_threads: torch intra-op threads during a step; None leaves torch's setting.
    """

    lr: float = 3e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    off_policy: str = "decoupled"
    is_cap: float | None = 2.0
    is_cap_mode: str = "auto"
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    micro_batch_tokens: int = 8192
    micro_batch_size: int | None = None
    updates_per_step: int = 1
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}; it must be positive")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas}; each must be in [0, 1)")
        if self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise ValueError("weight_decay must be >= 0 and max_grad_norm > 0")
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(
                f"eps_low={self.eps_low}, eps_high={self.eps_high}; use 0 <= eps_low < 1 "
                "and eps_high >= 0"
            )
        if self.off_policy not in OFF_POLICY_MODES:
            raise ValueError(f"off_policy={self.off_policy!r}; use one of {OFF_POLICY_MODES}")
        if self.is_cap is not None and not self.is_cap > 0:
            raise ValueError(f"is_cap={self.is_cap}; use a positive cap, or None for none")
        if self.is_cap_mode not in CAP_MODES:
            raise ValueError(f"is_cap_mode={self.is_cap_mode!r}; use one of {CAP_MODES}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage={self.advantage!r}; use one of {ADVANTAGES}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens}; use at least 1")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size}; use at least 1")
        if self.updates_per_step < 1:
            raise ValueError(
                f"updates_per_step={self.updates_per_step}; use at least 1 (1 = one update "
                "per batch)"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads}; use at least 1, or None")


@dataclass(frozen=True, slots=True, eq=False)
class _Sequence:
    traj_id: int
    ids: np.ndarray  # prompt + response, int64
    prompt_len: int
    behav: np.ndarray  # float32 logprobs of the response tokens
    advantage: float
    prox: np.ndarray | None = None  # proximal-policy logprobs, when computed apart


def _validate(batch: TrainingBatch, vocab_size: int) -> None:
    if not batch.groups or not any(g.trajectories for g in batch.groups):
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
            where = f"trajectory {t.traj_id} (group {group.group_id})"
            tokens, logprobs = np.asarray(t.tokens), np.asarray(t.logprobs)
            versions = np.asarray(t.versions)
            if tokens.ndim != 1 or logprobs.ndim != 1 or versions.ndim != 1:
                raise BatchError(f"{where}: tokens, logprobs and versions must be 1-D")
            if not len(tokens) == len(logprobs) == len(versions):
                raise BatchError(
                    f"{where}: {len(tokens)} tokens, {len(logprobs)} logprobs and "
                    f"{len(versions)} versions; they must be of one length"
                )
            if len(tokens) == 0:
                raise BatchError(f"{where}: the response is empty")
            if tokens.min() < 0 or tokens.max() >= vocab_size:
                raise BatchError(
                    f"{where}: token ids outside the model's vocabulary [0, {vocab_size})"
                )
            if not np.isfinite(logprobs).all():
                i = int(np.argmin(np.isfinite(logprobs)))
                raise BatchError(f"{where}: logprob {logprobs[i]} at position {i} is not finite")
            if logprobs.max() > _LOGPROB_SLACK:
                i = int(np.argmax(logprobs))
                raise BatchError(
                    f"{where}: logprob {logprobs[i]} at position {i} is positive; logprobs "
                    "must be <= 0"
                )
            if not math.isfinite(t.reward):
                raise BatchError(f"{where}: reward {t.reward} is not finite")


def _micro_batches(
    sequences: list[_Sequence], max_tokens: int, max_size: int | None
) -> Iterator[list[_Sequence]]:
    """Sequences sorted by length, cut so that ``count * longest <= max_tokens``."""
    ordered = sorted(sequences, key=lambda s: len(s.ids))  # stable: deterministic
    chunk: list[_Sequence] = []
    for seq in ordered:
        full = max_size is not None and len(chunk) >= max_size
        if chunk and (full or (len(chunk) + 1) * len(seq.ids) > max_tokens):
            yield chunk
            chunk = []
        chunk.append(seq)
    if chunk:
        yield chunk


def _pad(chunk: list[_Sequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids and, aligned with the next-token logits (width - 1), the response
    mask, targets, behaviour logprobs and advantages."""
    width = max(len(s.ids) for s in chunk)
    ids = np.full((len(chunk), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(chunk), width - 1), dtype=bool)
    behav = np.zeros((len(chunk), width - 1), dtype=np.float32)
    adv = np.zeros((len(chunk), width - 1), dtype=np.float32)
    prox = np.zeros((len(chunk), width - 1), dtype=np.float32)
    for i, s in enumerate(chunk):
        ids[i, : len(s.ids)] = s.ids
        # the logits at position t predict token t + 1
        span = slice(s.prompt_len - 1, len(s.ids) - 1)
        mask[i, span] = True
        behav[i, span] = s.behav
        adv[i, span] = s.advantage
        if s.prox is not None:
            prox[i, span] = s.prox
    ids_t = torch.from_numpy(ids)
    out = {
        "ids": ids_t,
        "targets": ids_t[:, 1:],
        "mask": torch.from_numpy(mask),
        "behav": torch.from_numpy(behav),
        "adv": torch.from_numpy(adv),
    }
    if chunk[0].prox is not None:
        out["prox"] = torch.from_numpy(prox)
    return out


class EmbeddedTrainer:
    """Trains ``model`` in place; implements :class:`staleflow.trainers.Trainer`.

    ``pad_id`` pads sequences (any id works: padding sits after every real token and
    causal attention never looks ahead). ``version`` is the policy version of the
    weights as given. ``tokenizer``, if given, is saved with checkpoints so that they
    load with :func:`staleflow.models.load_pretrained`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EmbeddedTrainerConfig | None = None,
        *,
        pad_id: int,
        version: int = 0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.model = model
        self.config = config or EmbeddedTrainerConfig()
        self.pad_id = int(pad_id)
        self._version = int(version)
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # a step and an export never interleave
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no trainable parameters")
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        c = self.config
        self.optimizer = torch.optim.AdamW(
            self._params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay, foreach=True
        )

    @property
    def version(self) -> int:
        return self._version

    # -- training -------------------------------------------------------------------

    def _sequences(self, batch: TrainingBatch) -> tuple[list[_Sequence], dict[str, float]]:
        rewards: list[float] = []
        group_index: list[int] = []
        trajs = []
        errors = 0
        for g, group in enumerate(batch.groups):
            for t in group.trajectories:
                if t.info.get("reward_error"):
                    # A reward function that raised says nothing about the response:
                    # training it as reward 0 would punish it like a wrong answer, and
                    # counting it in its group's mean would shift its siblings' advantages.
                    errors += 1
                    continue
                rewards.append(float(t.reward))
                group_index.append(g)
                trajs.append((group, t))
        advantages = group_advantages(
            torch.tensor(rewards, dtype=torch.float64),
            torch.tensor(group_index, dtype=torch.int64),
            normalize_std=self.config.advantage == "grpo",
            eps=self.config.adv_eps,
        ).tolist()
        sequences = []
        lengths = []
        staleness = []
        for (group, t), adv in zip(trajs, advantages, strict=True):
            prompt = np.asarray(group.prompt, dtype=np.int64)
            tokens = np.asarray(t.tokens, dtype=np.int64)
            sequences.append(
                _Sequence(
                    traj_id=t.traj_id,
                    ids=np.concatenate([prompt, tokens]),
                    prompt_len=len(prompt),
                    behav=np.minimum(np.asarray(t.logprobs, dtype=np.float32), 0.0),
                    advantage=float(adv),
                )
            )
            lengths.append(len(tokens))
            staleness.append(self._version - np.asarray(t.versions, dtype=np.float64))
        stale = np.concatenate(staleness) if staleness else np.zeros(1)
        by_group: dict[int, set[float]] = {}
        for g, r in zip(group_index, rewards, strict=True):
            by_group.setdefault(g, set()).add(r)
        flat_groups = len(batch.groups) - sum(1 for v in by_group.values() if len(v) > 1)
        nan = float("nan")
        stats = {
            "train/reward_mean": float(np.mean(rewards)) if rewards else nan,
            "train/reward_std": float(np.std(rewards)) if rewards else nan,
            "train/advantage_abs_mean": float(np.mean(np.abs(advantages))) if rewards else 0.0,
            "train/flat_group_frac": flat_groups / len(batch.groups),
            "train/response_len_mean": float(np.mean(lengths)) if lengths else 0.0,
            "train/response_len_max": float(np.max(lengths)) if lengths else 0.0,
            "train/trajectories": float(len(sequences)),
            "train/reward_errors": float(errors),
            "train/groups": float(len(batch.groups)),
            "train/token_staleness_mean": float(stale.mean()),
            "train/token_staleness_max": float(stale.max()),
        }
        return sequences, stats

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        """One AdamW step on ``batch``. See :class:`staleflow.trainers.Trainer`.

        The proximal policy of the off-policy correction is the weights before this
        step's update. The step accumulates gradients over all micro-batches and updates
        once, so those are the weights of its own forward passes: ``π_prox`` is their
        logprobs, detached, and no extra forward pass is needed. (The PPO ratio is then
        1 at the update and the clip is inactive; it bites in ``off_policy="none"``,
        where the ratio is taken against the behaviour policy.)
        """
        with self._lock:
            _validate(batch, self._vocab_size)
            start = time.perf_counter()
            sequences, stats = self._sequences(batch)
            c = self.config
            total = float(sum(len(s.ids) - s.prompt_len for s in sequences))
            sums = dict.fromkeys(
                ("loss", "clipped", "weight", "capped", "entropy", "kl", "ratio"), 0.0
            )
            was_training = self.model.training
            # dropout off: the loss must see the policy's own logprobs, as in verl/AReaL
            self.model.eval()
            threads = torch.get_num_threads()
            norms: list[float] = []
            try:
                if c.num_threads is not None:
                    torch.set_num_threads(c.num_threads)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(c.seed * 1_000_003 + self._version)
                    if c.updates_per_step > 1:
                        sequences = self._with_prox(sequences)
                    for part in _mini_batches(sequences, c.updates_per_step):
                        norms.append(self._update(part, sums))
            finally:
                torch.set_num_threads(threads)
                self.model.train(was_training)
            self._version += 1
            # no update at all (every reward failed): a NaN norm, 0 updates, same weights
            finite = bool(norms) and all(math.isfinite(g) for g in norms)
            grad_norm = float(np.mean(norms)) if finite else float("nan")
            n = max(total, 1.0)
            stats.update(
                {
                    "train/loss": sums["loss"],
                    "train/grad_norm": grad_norm,
                    "train/clip_frac": sums["clipped"] / n,
                    "train/importance_weight_mean": sums["weight"] / n,
                    "train/is_capped_frac": sums["capped"] / n,
                    "train/ratio_mean": sums["ratio"] / n,
                    "train/entropy": sums["entropy"] / n,
                    "train/kl_behav": sums["kl"] / n,
                    "train/tokens": total,
                    "train/skipped": float(sum(not math.isfinite(g) for g in norms)),
                    "train/updates": float(len(norms)),
                    "train/lr": float(self.optimizer.param_groups[0]["lr"]),
                    "train/step_time_s": time.perf_counter() - start,
                }
            )
            return stats

    def _update(self, sequences: list[_Sequence], sums: dict[str, float]) -> float:
        """One AdamW update on ``sequences``; returns the gradient norm before clipping."""
        c = self.config
        total = float(sum(len(s.ids) - s.prompt_len for s in sequences))
        self.optimizer.zero_grad(set_to_none=True)
        for chunk in _micro_batches(sequences, c.micro_batch_tokens, c.micro_batch_size):
            self._accumulate(_pad(chunk, self.pad_id), total, sums)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, c.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning(
                "step %d: gradient norm %s; skipping the update", self._version, grad_norm
            )
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _with_prox(self, sequences: list[_Sequence]) -> list[_Sequence]:
        """Attach the current weights' logprobs (the proximal policy) to each sequence."""
        c = self.config
        prox: dict[int, np.ndarray] = {}
        with torch.no_grad():
            for chunk in _micro_batches(sequences, c.micro_batch_tokens, c.micro_batch_size):
                mb = _pad(chunk, self.pad_id)
                logits = self.model(input_ids=mb["ids"], use_cache=False).logits[:, :-1]
                lp = torch.log_softmax(logits.float(), dim=-1)
                lp = lp.gather(-1, mb["targets"].unsqueeze(-1)).squeeze(-1)
                for i, s in enumerate(chunk):
                    span = slice(s.prompt_len - 1, len(s.ids) - 1)
                    prox[s.traj_id] = lp[i, span].numpy().copy()
        return [replace(s, prox=prox[s.traj_id]) for s in sequences]

    def _accumulate(
        self, mb: dict[str, torch.Tensor], total: float, sums: dict[str, float]
    ) -> None:
        c = self.config
        logits = self.model(input_ids=mb["ids"], use_cache=False).logits[:, :-1]
        mask = mb["mask"]
        # only response positions need the vocabulary-wide softmax
        resp_logits = logits[mask].float()
        log_probs = torch.log_softmax(resp_logits, dim=-1)
        logprobs = log_probs.gather(-1, mb["targets"][mask].unsqueeze(-1)).squeeze(-1)
        behav, adv = mb["behav"][mask], mb["adv"][mask]
        out = policy_loss(
            logprobs,
            behav,
            adv,
            torch.ones_like(logprobs),
            off_policy=c.off_policy,  # type: ignore[arg-type]
            prox_logprobs=mb["prox"][mask] if "prox" in mb else logprobs.detach(),
            eps_low=c.eps_low,
            eps_high=c.eps_high,
            is_cap=c.is_cap,
            is_cap_mode=c.is_cap_mode,
            total_tokens=total,
        )
        out.loss.backward()
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            sums["loss"] += out.loss.item()
            sums["clipped"] += float(out.clipped.sum())
            sums["weight"] += float(out.weights.sum())
            sums["capped"] += float(out.capped.sum())
            sums["ratio"] += float(out.ratio.sum())
            sums["entropy"] += float(entropy.sum())
            sums["kl"] += float(approx_kl(logprobs, behav).sum())

    # -- weights and checkpoints ------------------------------------------------------

    def export_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current weights by :func:`~staleflow.models.policy_state` name."""
        with self._lock:
            return {name: to_numpy(t).copy() for name, t in policy_state(self.model).items()}

    def save_checkpoint(self, path: str | Path) -> None:
        """Weights (``model.safetensors`` with the model's ``config.json``), optimizer
        state, torch's RNG states, version and config, written to a temporary directory
        and renamed into place; an existing checkpoint at ``path`` is replaced."""
        from staleflow.models.checkpoint import save_pretrained

        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        old = out.parent / f".old-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            try:
                if self.tokenizer is not None:
                    save_pretrained(self.model, self.tokenizer, tmp)
                else:
                    self.model.save_pretrained(tmp)
                torch.save(self.optimizer.state_dict(), tmp / _OPTIMIZER_FILE)
                torch.save(_rng_state(), tmp / _RNG_FILE)
                state = {"version": self._version, "config": asdict(self.config)}
                (tmp / _STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
                if out.exists():
                    out.rename(old)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
        logger.info("saved trainer checkpoint (version %d) to %s", self._version, out)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore weights, optimizer state, RNG states and version written by
        :meth:`save_checkpoint`."""
        from safetensors.torch import load_file

        p = Path(path)
        shards = sorted(p.glob("*.safetensors")) if p.is_dir() else []
        for name in (_OPTIMIZER_FILE, _STATE_FILE):
            if not (p / name).is_file():
                raise FileNotFoundError(f"{p}: not a trainer checkpoint (no {name})")
        if not shards:
            raise FileNotFoundError(f"{p}: not a trainer checkpoint (no *.safetensors)")
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:  # large models are saved in several shards
            tensors.update(load_file(str(shard)))
        state = json.loads((p / _STATE_FILE).read_text())
        names = set(dict(self.model.named_parameters()))
        with self._lock:
            load_policy_state(self.model, {k: v for k, v in tensors.items() if k in names})
            self.optimizer.load_state_dict(torch.load(p / _OPTIMIZER_FILE, weights_only=True))
            if (p / _RNG_FILE).is_file():  # absent in checkpoints written before it was kept
                _set_rng_state(torch.load(p / _RNG_FILE, weights_only=True))
            self._version = int(state["version"])
        logger.info("loaded trainer checkpoint (version %d) from %s", self._version, p)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"EmbeddedTrainer(version={self._version}, lr={c.lr}, off_policy={c.off_policy!r}, "
            f"advantage={c.advantage!r})"
        )


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{i}"] = s
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def config_from_dict(values: dict[str, Any]) -> EmbeddedTrainerConfig:
    """An :class:`EmbeddedTrainerConfig` from plain values (e.g. a YAML section), rejecting
    unknown keys by name."""
    known = set(EmbeddedTrainerConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown trainer settings {unknown}; known: {sorted(known)}")
    return EmbeddedTrainerConfig(**values)


def _mini_batches(sequences: list[_Sequence], parts: int) -> list[list[_Sequence]]:
    """``parts`` contiguous slices of the batch (groups stay mostly together; their
    advantages were computed over the whole group already)."""
    parts = max(1, min(parts, len(sequences)))
    bounds = np.linspace(0, len(sequences), parts + 1).round().astype(int)
    return [sequences[a:b] for a, b in pairwise(bounds.tolist()) if b > a]
