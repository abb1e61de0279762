"""Named sizes of the small Qwen2-architecture models built from code (no downloads).

Plain data, importable without torch, so configuration code can list and validate presets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """The architecture knobs of a Qwen2 decoder; the vocabulary comes from the tokenizer.

    The KV heads must divide the attention heads (grouped-query attention), and the heads
    the hidden size; ``tie_embeddings`` shares the input embedding with the output layer,
    which for a tiny vocabulary saves nothing but keeps one fewer tensor to push around.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool = True
    max_position_embeddings: int = 512
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; it must be at least 1")
        if self.intermediate_size < 1 or self.max_position_embeddings < 1:
            raise ValueError("intermediate_size and max_position_embeddings must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self, vocab_size: int) -> int:
        """Parameter count of the model this preset builds (tied weights counted once)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k, v (bias), o
        mlp = 3 * h * self.intermediate_size
        layer = attention + mlp + 2 * h  # two RMSNorm weights
        embeddings = vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embeddings + h  # the final norm

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, ModelPreset] = {
    # the default policy of the built-in task: about 2.9M parameters with the 17-token
    # arithmetic vocabulary, small enough to warm up and train on two CPU cores
    "tiny": ModelPreset(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688
    ),
    # for unit tests: about 19K parameters, a forward pass takes well under a millisecond
    "micro": ModelPreset(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
    ),
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; use one of {sorted(PRESETS)} or pass a ModelPreset"
        ) from None
