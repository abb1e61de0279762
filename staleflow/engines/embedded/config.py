"""Settings of the embedded CPU rollout engine, checked up front with fix-it messages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmbeddedEngineConfig:
    """What the embedded engine may hold and how it samples.

    kv_budget_tokens: the §5.2 ``M``: the most KV tokens the running batch may hold, where a
        running request holds ``prompt + response so far`` tokens (the last sampled token is
        counted although its K/V is only written by the next decode step, so the count is
        what the cache holds right after that step). Must be >= ``max_seq_len`` so that any
        request the engine accepts fits on its own.
    max_running: batch slots, i.e. the most requests decoded together.
    max_seq_len: longest ``prompt + max_response`` accepted; sizes each slot of the cache.
    temperature: 0 samples greedily; otherwise softmax(logits / temperature).
    top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    eos_token_id: token id(s) that end a response (included in it); None: length stops only.
    seed: seeds the sampler; see ``sampling`` for how draws are keyed.
    num_threads: if set, ``torch.set_num_threads`` at construction (a process-wide setting).
    max_prefill_tokens: padded tokens (requests x longest prefix) per batched prefill forward;
        a longer single prefix still runs, alone.
    """

    kv_budget_tokens: int
    max_running: int = 64
    max_seq_len: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int | Sequence[int] | None = None
    seed: int = 0
    num_threads: int | None = None
    max_prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        _positive_int("max_running", self.max_running, "the number of requests decoded together")
        _positive_int("max_seq_len", self.max_seq_len, "the longest prompt + response accepted")
        _positive_int("kv_budget_tokens", self.kv_budget_tokens, "the KV-cache budget M in tokens")
        _positive_int(
            "max_prefill_tokens", self.max_prefill_tokens, "padded tokens per prefill forward"
        )
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
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads, "torch threads (None: leave as is)")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when None)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)


def _positive_int(name: str, value: object, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({meaning}) must be a positive int, got {value!r}")
