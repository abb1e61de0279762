"""The KV of finished turns, kept for the trajectory's next turn (multi-turn tasks).

A turn that ends at the stop token leaves the engine, the environment answers it, and the
trajectory comes back with ``prompt + turns + observation``: everything but the
observation was prefilled or decoded here already. The engine keeps a copy of that
request's cache row, keyed by trajectory, and on the next turn's admission copies the
longest common prefix back into a row and prefills only the rest
(:meth:`~staleflow.engines.embedded.runner.ModelRunner.extend`).

Bounded by tokens and by trajectories, least recently stored evicted first. The store is
emptied at every weight load: a prefix's K/V are a function of its tokens *and the
weights*, and the next turn must be generated exactly as a full re-prefill under the new
weights would (what vLLM does too: its prefix cache is reset at a load). The prefix's
tokens keep their recorded logprobs and versions either way: those live in the request,
not in the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, eq=False)
class HeldPrefix:
    """The K/V of ``tokens`` at positions ``0..len(tokens)-1``, per layer
    ``[kv_heads, len(tokens), head_dim]``."""

    tokens: np.ndarray
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class PrefixStore:
    """At most ``max_tokens`` tokens of at most ``max_trajs`` trajectories."""

    def __init__(self, max_tokens: int, max_trajs: int) -> None:
        self.max_tokens = max_tokens
        self.max_trajs = max_trajs
        self._held: OrderedDict[int, HeldPrefix] = OrderedDict()
        self.tokens = 0
        self.evictions = 0

    def put(self, traj_id: int, prefix: HeldPrefix) -> bool:
        """Keep ``prefix`` for ``traj_id`` (replacing one it had), evicting the least
        recently stored; False (nothing kept) if it alone exceeds the bound."""
        self.drop([traj_id])
        n = len(prefix.tokens)
        if n == 0 or n > self.max_tokens or self.max_trajs < 1:
            return False
        while self._held and (
            self.tokens + n > self.max_tokens or len(self._held) >= self.max_trajs
        ):
            _, old = self._held.popitem(last=False)
            self.tokens -= len(old.tokens)
            self.evictions += 1
        self._held[traj_id] = prefix
        self.tokens += n
        return True

    def take(self, traj_id: int) -> HeldPrefix | None:
        """Remove and return ``traj_id``'s prefix (it moves into a running row)."""
        prefix = self._held.pop(traj_id, None)
        if prefix is not None:
            self.tokens -= len(prefix.tokens)
        return prefix

    def drop(self, traj_ids: Iterable[int]) -> list[int]:
        dropped = []
        for tid in traj_ids:
            if self.take(tid) is not None:
                dropped.append(tid)
        return dropped

    def clear(self) -> None:
        self._held.clear()
        self.tokens = 0

    def held(self) -> tuple[int, ...]:
        """Trajectory ids, least recently stored first (the next to be evicted)."""
        return tuple(self._held)

    def sizes(self) -> tuple[tuple[int, int], ...]:
        """(trajectory id, tokens kept) in :meth:`held`'s order."""
        return tuple((tid, len(p.tokens)) for tid, p in self._held.items())


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
