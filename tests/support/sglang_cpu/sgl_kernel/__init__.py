"""Stand-in for ``sgl_kernel``'s CPU build, in CI's SGLang environment only (``.ci/sglang``).

SGLang 0.5.23 on ``--device cpu`` imports a handful of entry points of its kernel package
``sgl_kernel``. The registry's kernel wheel (``sglang-kernel``) is CUDA-only (it needs
``libcuda.so.1``) and has no source distribution, and its CPU build needs SGLang's
repository and an AMX toolchain. This package provides exactly the entry points the CPU
path of a dense Qwen2 server reaches, written in plain PyTorch, so that SGLang's own
scheduler, HTTP API, pause/continue and weight-update routes run for real in CI
(docs/engines.md says what was checked this way). It is not SGLang's kernel library: speed
is not its aim, and anything else it is asked for raises naming this package.
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+staleflow.standin"


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy token rows ``src_loc`` to ``tgt_loc`` in every KV buffer: buffer ``i`` starts
    at address ``data_ptrs[i]`` and holds one row of ``strides[i]`` bytes per token slot
    (``sglang/kernels/ops/kvcache/cache_move.py`` calls it so on CPU)."""
    src = src_loc.tolist()
    tgt = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = {
            t: ctypes.string_at(base + s * stride, stride) for s, t in zip(src, tgt, strict=True)
        }
        for t, row in rows.items():  # read every source first: the ranges may overlap
            ctypes.memmove(base + t * stride, row, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of ``req_to_token``: request ``i``
    gets ``out_cache_loc``'s next ``end_offset[i] - start_offset[i]`` slots at columns
    ``start_offset[i]:end_offset[i]`` (as the Triton kernel ``assign_req_to_token_pool``
    of ``sglang/srt/mem_cache/allocation.py`` does on GPU)."""
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + n]
        taken += n


# -- torch.ops.sgl_kernel --------------------------------------------------------------

_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) held in int64, in two 16-bit halves of
    ``c`` so that no product leaves int64."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _MASK


def _murmur_hash32(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """MurmurHash3 of (seed low, seed high, position, column) for every row and column,
    as ``sglang/kernels/ops/sampling/murmur_hash.py``'s Triton kernel computes it: the
    uniform numbers of SGLang's seeded sampling (``multinomial_with_seed``)."""
    s = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    h = torch.zeros_like(s)
    h = _mix(h, s & _MASK)
    h = _mix(h, (s >> 32) & _MASK)
    h = _mix(h, positions.to(torch.int64) & _MASK)
    h = _mix(h[:, None], (col_indices.to(torch.int64) & _MASK)[None, :])
    h = h ^ 16
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


_LIB = torch.library.Library("sgl_kernel", "DEF")
_LIB.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
_LIB.impl("murmur_hash32_cpu", _murmur_hash32, "CPU")


# -- imported at start-up, never called by a server without speculative decoding ---------


def _not_provided(name: str, what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} ({what}): StaleFlow's stand-in for sgl_kernel "
            "(tests/support/sglang_cpu) does not provide it"
        )

    call.__name__ = name
    return call


_SPECULATIVE = "speculative decoding"
build_tree_kernel_efficient_cpu = _not_provided("build_tree_kernel_efficient_cpu", _SPECULATIVE)
verify_tree_greedy_cpu = _not_provided("verify_tree_greedy_cpu", _SPECULATIVE)
assign_draft_cache_locs_contiguous_cpu = _not_provided(
    "assign_draft_cache_locs_contiguous_cpu", _SPECULATIVE
)
assign_extend_cache_locs_cpu = _not_provided("assign_extend_cache_locs_cpu", _SPECULATIVE)
fill_accept_out_cache_loc_cpu = _not_provided("fill_accept_out_cache_loc_cpu", _SPECULATIVE)
fill_bonus_tokens_cpu = _not_provided("fill_bonus_tokens_cpu", _SPECULATIVE)
