"""The settings every rollout engine shares: capacity and how it samples.

Each backend's config extends :class:`EngineSettings` with its own knobs, so these bounds
are defined and checked once (with fix-it messages) whatever the backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What an engine may hold and how it samples.

    kv_budget_tokens: the §5.2 ``M``: the most KV tokens the running batch may hold, where a
        running request holds ``prompt + response so far`` tokens. Must be >= ``max_seq_len``
        so that any request the engine accepts fits on its own.
    max_running: batch slots, i.e. the most requests decoded together.
    max_seq_len: longest ``prompt + max_response`` accepted.
    temperature: 0 samples greedily; otherwise softmax(logits / temperature).
    top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    eos_token_id: token id(s) that end a response (included in it); None: length stops only.
    seed: seeds the sampler.

    Every engine reports ``log_softmax(logits / temperature)[token]`` for each sampled token,
    before top-p truncation (``log_softmax(logits)`` when greedy): the project's logprob
    convention, which the trainer's importance ratios compare against.
    """

    kv_budget_tokens: int
    max_running: int = 64
    max_seq_len: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int | Sequence[int] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        positive_int("max_running", self.max_running, "the number of requests decoded together")
        positive_int("max_seq_len", self.max_seq_len, "the longest prompt + response accepted")
        positive_int("kv_budget_tokens", self.kv_budget_tokens, "the KV-cache budget M in tokens")
        if self.kv_budget_tokens < self.max_seq_len:
            raise ValueError(
                f"kv_budget_tokens={self.kv_budget_tokens} is below max_seq_len="
                f"{self.max_seq_len}: a request of max_seq_len tokens could never run; raise "
                "kv_budget_tokens or lower max_seq_len"
            )
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 for greedy), got {self.temperature!r}"
            )
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 for greedy), got {self.temperature}; "
                "use 0 for greedy decoding or a positive value to sample"
            )
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"top_p must be in (0, 1] (1 disables nucleus sampling), got {self.top_p!r}"
            )
        for tok in self.eos_ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(
                    f"eos_token_id must be a non-negative int, a sequence of them or None, "
                    f"got {self.eos_token_id!r}"
                )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def request_seed(self, traj_id: int) -> int:
        """The sampling seed of a request of ``traj_id``: keyed by the run's seed and the
        trajectory, so its draws are the same on every instance (an engine draws each token
        from it and the token's position). In [0, 2**31), an int every engine's seed field
        takes."""
        return (self.seed * 1_000_003 + traj_id * 7_919) % (2**31)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when None)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)


def positive_int(name: str, value: object, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({meaning}) must be a positive int, got {value!r}")
