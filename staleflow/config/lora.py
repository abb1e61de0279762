"""``trainer.lora``: train low-rank adapters instead of the full weights.

With ``trainer.lora.enabled`` the trainer freezes the policy's weights (the *base*) and
trains a LoRA adapter (Hu et al. 2021) on the linear layers ``target_modules`` names:
each such layer computes ``W x + (alpha / rank) B A x``. What changes beyond the trainer's
memory is what every version moves: the base reaches the parameter server and each
rollout instance once, and every later version is the adapter alone (``docs/training.md``).

The checks here are the ones that need no model; a target module the model does not have
is refused at start, once the model is built (:func:`staleflow.models.lora.check_targets`).
Messages name the dotted key and the fix, as in :mod:`staleflow.config.sections`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

from staleflow.config.checks import _help, require, require_at_least
from staleflow.config.walk import check_types

# the linear layers of a Qwen2 / Llama decoder block: attention and MLP
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_RANK = 4096
RANK_WHY = "the rank of a low-rank update: at 4,096 it is as wide as a 4k model's full layer"


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """The adapter the trainer trains with ``enabled``."""

    KEY: ClassVar[str] = "trainer.lora"

    enabled: bool = field(
        default=False,
        metadata=_help(
            "train a LoRA adapter on frozen weights (embedded trainer; the embedded rollout "
            "engine loads it per version); each version then carries only the adapter"
        ),
    )
    rank: int = field(
        default=16,
        metadata=_help("rank r of each adapter (A: r x in, B: out x r)", MAX_RANK, RANK_WHY),
    )
    alpha: float = field(
        default=32.0,
        metadata=_help(
            "the adapter's scale is alpha / rank",
            1e6,
            "alpha / rank scales the update: a million multiplies it past any float32 range",
        ),
    )
    dropout: float = field(
        default=0.0,
        metadata=_help(
            "dropout on the adapters' input in the gradient pass only (the proximal and "
            "reference passes and the engines never drop): 0 keeps the trained logprobs the "
            "policy's own",
            1.0,
            "a probability, in [0, 1)",
        ),
    )
    target_modules: str = field(
        default=DEFAULT_TARGETS,
        metadata=_help(
            "comma-separated names of the linear layers that get adapters (the last part of "
            "their module path, e.g. q_proj,v_proj)"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_at_least(
            f"{self.KEY}.rank",
            self.rank,
            1,
            "(a rank-0 adapter is no adapter), e.g. 16; to train the full weights set "
            "trainer.lora.enabled=false",
        )
        require(
            math.isfinite(self.alpha) and self.alpha > 0,
            f"{self.KEY}.alpha",
            self.alpha,
            "must be > 0 (the adapter's scale is alpha / rank), e.g. 32",
        )
        require(
            0.0 <= self.dropout < 1.0,
            f"{self.KEY}.dropout",
            self.dropout,
            "is out of range: use [0, 1), e.g. 0.0",
        )
        names = self.targets
        bad = [n for n in names if not _MODULE_NAME.fullmatch(n)]
        require(
            bool(names) and not bad,
            f"{self.KEY}.target_modules",
            self.target_modules,
            "must name linear layers, comma-separated: use e.g. "
            f"{DEFAULT_TARGETS}" + (f" ({bad[0]!r} is not a module name)" if bad else ""),
        )

    @property
    def targets(self) -> tuple[str, ...]:
        """The target module names, in order, without blanks or repeats."""
        parts = (p.strip() for p in self.target_modules.split(","))
        return tuple(dict.fromkeys(p for p in parts if p))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
