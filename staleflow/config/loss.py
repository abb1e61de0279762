"""The trainer's algorithm keys: the policy loss, its aggregation, the KL to a frozen
reference policy and dynamic sampling (``trainer.loss``, ``trainer.loss_agg``,
``trainer.kl_coef``, ``trainer.ref``, ``trainer.dynamic_sampling``). :class:`LossSettings` is the base of
:class:`staleflow.config.sections.TrainerConfig`: the keys are the ``trainer`` section's.
The maths is :mod:`staleflow.trainers.losses`; docs/training.md has every option with its
formula. Messages name the dotted key and the fix, as in :mod:`staleflow.config.sections`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from staleflow.config.checks import (
    MAX_SEQUENCE_TOKENS,
    SEQUENCE_WHY,
    _help,
    require,
    require_choice,
)
from staleflow.config.walk import check_types

# staleflow.trainers.losses.LOSSES / AGGREGATIONS / KL_ESTIMATORS, not imported: the
# configuration stays importable without torch
LOSSES = ("ppo", "gspo", "cispo")
LOSS_AGGS = (
    "auto",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_KL_COEF = 100.0
KL_COEF_WHY = (
    "a weight on the per-token KL; GRPO uses 0.04 and verl 0.001: at 100 the KL term "
    "drowns the policy gradient and the policy never leaves the reference"
)
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model*.safetensors.index.json")
# Keys of a config.json that fix the shapes of the weights: two folders that differ in one
# hold models of different architectures (also the Megatron checkpoint's check)
SHAPE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "tie_word_embeddings",
)


def model_folder_problem(path: str) -> str | None:
    """Why ``path`` is not a Hugging Face model folder (config.json with a model_type,
    and weights), or None. Pure: no torch, no transformers."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return "is not a directory" if p.exists() else "does not exist"
    config = p / "config.json"
    if not config.is_file():
        return "is not a model folder (no config.json)"
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"has a config.json that does not read ({exc})"
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        return "has a config.json with no model_type (not a transformers model)"
    if not any(any(p.glob(pattern)) for pattern in _WEIGHT_FILES):
        return "has no weights (model.safetensors or pytorch_model.bin)"
    return None


def _config_json(folder: str) -> dict | None:
    try:
        parsed = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return parsed if isinstance(parsed, dict) else None


def architecture_mismatch(reference: str, policy: str) -> str | None:
    """The shape keys (:data:`SHAPE_KEYS`) whose values differ between the config.json of
    model folders ``reference`` and ``policy``, said in words; None when they agree or a
    config cannot be read (the folder checks name that). Pure: reads two JSON files."""
    ref, pol = _config_json(reference), _config_json(policy)
    if ref is None or pol is None:
        return None
    differ = [k for k in SHAPE_KEYS if ref.get(k) != pol.get(k)]
    if not differ:
        return None
    return ", ".join(
        f"{k} {ref.get(k)!r} (reference) vs {pol.get(k)!r} (policy)" for k in differ[:3]
    )


@dataclass(frozen=True, slots=True)
class RefConfig:
    """The frozen reference policy of the KL term (``trainer.kl_coef``)."""

    KEY: ClassVar[str] = "trainer.ref"

    path: str = field(
        default="",
        metadata=_help(
            "Hugging Face model folder of the reference policy (the policy's architecture, "
            "e.g. a trainer checkpoint or model.checkpoint); '' = the initial policy"
        ),
    )
    track: bool = field(
        default=False,
        metadata=_help(
            "compute the reference's logprobs and report train/ref_kl even with "
            "trainer.kl_coef=0 (one more forward pass per step)"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        if self.path:
            problem = model_folder_problem(self.path)
            require(
                problem is None,
                f"{self.KEY}.path",
                self.path,
                f"{problem}: set it to a Hugging Face model folder of the policy's "
                "architecture (config.json and model.safetensors, e.g. <run>/checkpoint or "
                "model.checkpoint), or drop it to use the initial policy",
            )


@dataclass(frozen=True, slots=True)
class LossSettings:
    """The algorithm keys of the ``trainer`` section (see the module doc)."""

    loss: str = field(
        default="ppo",
        metadata=_help(
            "policy loss: ppo (token ratio, clipped) | gspo (sequence ratio, clipped per "
            "sequence; use eps_low=3e-4 eps_high=4e-4) | cispo (clipped, stop-gradient "
            "importance weight x logprob); docs/training.md"
        ),
    )
    loss_agg: str = field(
        default="auto",
        metadata=_help(
            "aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum | "
            "seq_mean_token_sum_norm (Dr. GRPO: / trainer.loss_norm_len) | auto "
            "(seq_mean_token_sum_norm for advantage=drgrpo, seq_mean_token_mean for "
            "loss=gspo, token_mean otherwise)"
        ),
    )
    loss_norm_len: int = field(
        default=0,
        metadata=_help(
            "the constant length of seq_mean_token_sum_norm; 0 = rollout.max_response_tokens",
            MAX_SEQUENCE_TOKENS,
            SEQUENCE_WHY,
        ),
    )
    kl_coef: float = field(
        default=0.0,
        metadata=_help(
            "weight of the KL to the reference policy (trainer.ref) in the loss; 0 = no KL "
            "term and no reference",
            MAX_KL_COEF,
            KL_COEF_WHY,
        ),
    )
    kl_estimator: str = field(
        default="k3",
        metadata=_help(
            "estimator of KL(policy || reference) per token: k1 | k2 | k3 (Schulman 2020; "
            "k3 is GRPO's)"
        ),
    )
    ref: RefConfig = field(default_factory=RefConfig)
    # verl's algorithm.filter_groups.enable; the control plane applies it (at the Occupy of
    # a group), since the trainer never sees a group that was dropped
    dynamic_sampling: bool = field(
        default=False,
        metadata=_help(
            "DAPO's dynamic sampling: drop each completed group whose rewards are all equal "
            "(no learning signal under group-relative advantages) before training; its "
            "buffer entry is refilled (docs/staleness.md)"
        ),
    )
    dynamic_sampling_max_drop: float = field(
        default=0.75,
        metadata=_help(
            "with dynamic_sampling: the largest share of a step's completed groups that is "
            "dropped (0.75: up to 3 batches' worth a step); beyond it uniform groups are "
            "trained on as they are, so that a run whose groups are nearly all uniform does "
            "not stall",
            0.95,
            "a share s drops batch_size x s / (1 - s) groups a step: at 0.95 the rollout "
            "makes 20 groups for each one trained",
        ),
    )

    def _check_loss(self) -> None:
        require_choice("trainer.loss", self.loss, LOSSES, "docs/training.md")
        require_choice("trainer.loss_agg", self.loss_agg, LOSS_AGGS)
        require(
            self.loss_norm_len >= 0,
            "trainer.loss_norm_len",
            self.loss_norm_len,
            "is negative: use 0 (= rollout.max_response_tokens) or a token count, e.g. 1024",
        )
        require(
            math.isfinite(self.kl_coef) and self.kl_coef >= 0,
            "trainer.kl_coef",
            self.kl_coef,
            "must be >= 0 (it weighs a penalty): use 0 for no KL term, e.g. 0.001",
        )
        require_choice("trainer.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        require(
            0.0 <= self.dynamic_sampling_max_drop < 1.0,
            "trainer.dynamic_sampling_max_drop",
            self.dynamic_sampling_max_drop,
            "must be a share in [0, 0.95]: e.g. 0.75 (0 filters nothing)",
        )

    def aggregation(self, advantage: str) -> str:
        """``loss_agg`` with ``auto`` resolved (see its help)."""
        if self.loss_agg != "auto":
            return self.loss_agg
        if advantage == "drgrpo":
            return "seq_mean_token_sum_norm"
        if self.loss == "gspo":
            return "seq_mean_token_mean"
        return "token_mean"

    @property
    def uses_reference(self) -> bool:
        """Whether the trainer keeps a reference policy and scores each batch with it."""
        return self.kl_coef > 0 or self.ref.track or bool(self.ref.path)
