"""A preallocated, slot-based KV cache: one row per running request, written in place.

Each layer holds ``k`` and ``v`` of shape ``[slots, kv_heads, max_seq_len, head_dim]``.
Running requests occupy rows ``0 .. n-1`` with no holes, so a decode step attends over the
plain view ``[:n, :, :longest]`` instead of gathering rows; a request that leaves has its
hole filled by moving the last row into it (one copy of that request's prefix, far cheaper
than gathering every row at every step). Nothing grows per step, unlike ``torch.cat``
caches.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (slots, kv_heads, max_seq_len, head_dim)
        # Zeros, not empty: masked-out keys are still multiplied, and NaN garbage times a
        # zero attention weight would poison the output.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots = slots
        self.max_seq_len = max_seq_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def write_prefix(
        self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``/``v`` ``[n, kv_heads, L, head_dim]`` at positions ``0..L-1`` of
        ``rows``. Padding past a request's length lands beyond its valid length, where it is
        masked and later overwritten."""
        length = k.shape[2]
        self.k[layer][rows, :, :length] = k
        self.v[layer][rows, :, :length] = v

    def write_token(
        self, layer: int, n: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write one token per row ``0..n-1`` (``k``/``v`` ``[n, kv_heads, head_dim]``) at
        each row's own position."""
        rows = torch.arange(n, device=positions.device)
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    def write_at(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write one token per entry (``k``/``v`` ``[N, kv_heads, head_dim]``) at
        ``rows[j]``, ``positions[j]``: a batch of prefix extensions, each at its own offset."""
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    def read_row(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row ``row``'s first ``length`` positions, per layer
        (``[kv_heads, length, head_dim]``): kept past the row's release."""
        return (
            [t[row, :, :length].clone() for t in self.k],
            [t[row, :, :length].clone() for t in self.v],
        )

    def write_row(
        self, row: int, k: list[torch.Tensor], v: list[torch.Tensor], length: int
    ) -> None:
        """Put the first ``length`` positions of per-layer copies (``read_row``'s) back
        into row ``row`` at positions ``0..length-1``."""
        for dst, src in zip((*self.k, *self.v), (*k, *v), strict=True):
            dst[row, :, :length] = src[:, :length]

    def view(self, layer: int, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows ``0..n-1``, positions ``0..length-1`` (views, no copy)."""
        return self.k[layer][:n, :, :length], self.v[layer][:n, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst``."""
        if src == dst or length <= 0:
            return
        for t in (*self.k, *self.v):
            t[dst, :, :length] = t[src, :, :length]
