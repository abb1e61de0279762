"""Settings of the embedded CPU rollout engine, checked up front with fix-it messages."""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.engines.settings import EngineSettings, positive_int


@dataclass(frozen=True, slots=True)
class EmbeddedEngineConfig(EngineSettings):
    """:class:`~staleflow.engines.settings.EngineSettings` plus the embedded engine's own.

    kv_budget_tokens: a running request holds ``prompt + response so far`` tokens (the last
        sampled token is counted although its K/V is only written by the next decode step, so
        the count is what the cache holds right after that step).
    max_seq_len: also sizes each slot of the cache.
    seed: see ``sampling`` for how draws are keyed.
    num_threads: if set, ``torch.set_num_threads`` at construction (a process-wide setting).
    max_prefill_tokens: padded tokens (requests x longest prefix) per batched prefill forward;
        a longer single prefix still runs, alone.
    prefix_cache_tokens: KV tokens of finished turns kept for their trajectory's next turn
        (``prefix_store``), beside the running batch's budget; 0 (default): none kept.
    prefix_cache_trajs: trajectories whose prefix is kept at most (least recent evicted).
    """

    num_threads: int | None = None
    max_prefill_tokens: int = 8192
    prefix_cache_tokens: int = 0
    prefix_cache_trajs: int = 256

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        positive_int(
            "max_prefill_tokens", self.max_prefill_tokens, "padded tokens per prefill forward"
        )
        for name in ("prefix_cache_tokens", "prefix_cache_trajs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: keep no prefix), got {value!r}")
        if self.num_threads is not None:
            positive_int("num_threads", self.num_threads, "torch threads (None: leave as is)")
