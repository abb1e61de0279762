"""The forward pass of a ``transformers`` decoder, run over the slot KV cache.

We call the HF model's own modules (embeddings, norms, projections, MLP, rotary embedding,
LM head) so weights and numerics are the model's, but drive attention ourselves with
``scaled_dot_product_attention`` over the preallocated cache: HF ``generate`` concatenates
every layer's cache at every step and rebuilds masks, which dominates small-model decode.

Supported: Qwen2 (``Qwen2ForCausalLM``) and models with the same module layout (Llama,
Mistral without sliding windows, Qwen3 with its per-head q/k norms), GQA and tied
embeddings (the LM head module is used as is, whatever it shares).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from staleflow.engines.embedded.kv_cache import SlotKVCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int | None
    dtype: torch.dtype
    device: torch.device


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class ModelRunner:
    """Prefill and decode forwards of one causal LM over a :class:`SlotKVCache`."""

    def __init__(self, model: nn.Module) -> None:
        base = getattr(model, "model", None)
        lm_head = getattr(model, "lm_head", None)
        missing = [
            name
            for name, ok in (
                ("model", base is not None),
                ("lm_head", lm_head is not None),
                ("model.embed_tokens", hasattr(base, "embed_tokens")),
                ("model.layers", hasattr(base, "layers")),
                ("model.norm", hasattr(base, "norm")),
                ("model.rotary_emb", hasattr(base, "rotary_emb")),
            )
            if not ok
        ]
        if missing:
            raise ValueError(
                f"{type(model).__name__} lacks {', '.join(missing)}: the embedded engine runs "
                "Qwen2/Llama-style *ForCausalLM models from transformers"
            )
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"{type(model).__name__} has non-full attention layers {sorted(set(layer_types))}"
                "; the embedded engine supports full attention only (disable sliding windows)"
            )
        self.model = model
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = lm_head
        num_heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        attn0 = self.layers[0].self_attn
        head_dim = int(
            getattr(attn0, "head_dim", None)
            or getattr(cfg, "head_dim", None)
            or cfg.hidden_size // num_heads
        )
        if num_heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        self.scaling = float(getattr(attn0, "scaling", head_dim**-0.5))
        param = next(model.parameters())
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=num_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(cfg.vocab_size),
            max_positions=getattr(cfg, "max_position_embeddings", None),
            dtype=param.dtype,
            device=param.device,
        )
        self._rep = num_heads // kv_heads

    def new_cache(self, slots: int, max_seq_len: int) -> SlotKVCache:
        s = self.shape
        return SlotKVCache(
            num_layers=s.num_layers,
            slots=slots,
            kv_heads=s.kv_heads,
            max_seq_len=max_seq_len,
            head_dim=s.head_dim,
            dtype=s.dtype,
            device=s.device,
        )

    def _qkv(
        self, attn: nn.Module, x: torch.Tensor, q_shape: tuple[int, ...], kv_shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = attn.q_proj(x).view(q_shape)
        k = attn.k_proj(x).view(kv_shape)
        v = attn.v_proj(x).view(kv_shape)
        # Qwen3-style per-head RMS norms act on head_dim, the last axis in any layout.
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        return q, k, v

    @torch.inference_mode()
    def prefill(
        self,
        cache: SlotKVCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
        *,
        want_logits: bool = False,
    ) -> torch.Tensor | None:
        """Write K/V of ``ids`` ``[n, L]`` (right-padded; row ``i`` valid up to
        ``lengths[i]``) into cache ``rows`` at positions ``0..L-1``. Returns the float32
        logits ``[n, L, vocab]`` if ``want_logits`` (tests), else None: the engine samples
        only in decode, so prefill skips the last layer's attention/MLP and the LM head."""
        n, length = ids.shape
        nh, kvh, hd = self.shape.num_heads, self.shape.kv_heads, self.shape.head_dim
        h = self.embed(ids)
        cos, sin = self.rotary(h, torch.arange(length, device=ids.device)[None])
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, L, D], broadcast over rows and heads
        if int(lengths.min()) == length:  # no padding: the plain causal kernel suffices
            mask, causal = None, True
        else:
            pos = torch.arange(length, device=ids.device)
            mask = (pos[None, :] <= pos[:, None])[None, None] & (
                pos[None, None, None, :] < lengths[:, None, None, None]
            )
            causal = False
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, (n, length, nh, hd), (n, length, kvh, hd))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache.write_prefix(i, rows, k, v)
            if i == last and not want_logits:
                return None  # the last layer's output only feeds the (unneeded) LM head
            if self._rep > 1:
                k = k.repeat_interleave(self._rep, dim=1)
                v = v.repeat_interleave(self._rep, dim=1)
            a = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling
            )
            h = h + attn.o_proj(a.transpose(1, 2).reshape(n, length, nh * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).float()

    @torch.inference_mode()
    def extend(
        self,
        cache: SlotKVCache,
        ids: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
        *,
        want_logits: bool = False,
    ) -> torch.Tensor | None:
        """Prefill the continuation of prefixes already in the cache: row ``rows[i]`` holds
        positions ``0..starts[i]-1``; ``ids`` ``[n, L]`` (right-padded, row ``i`` valid up
        to ``lengths[i]``) go at positions ``starts[i]..`` and attend to the held prefix and
        causally to each other. A prefix's K/V is a function of its tokens alone, so the
        result is that of :meth:`prefill` over the whole sequence (up to float rounding).
        Returns logits ``[n, L, vocab]`` if ``want_logits`` (tests), else None."""
        n, length = ids.shape
        nh, kvh, hd = self.shape.num_heads, self.shape.kv_heads, self.shape.head_dim
        offsets = torch.arange(length, device=ids.device)
        positions = starts[:, None] + offsets[None]  # [n, L]
        valid = offsets[None] < lengths[:, None]
        # only real tokens are written: a padded one could land on a valid position of a
        # row whose continuation ends at max_seq_len
        write_rows = rows[:, None].expand(n, length)[valid]
        write_pos = positions[valid]
        span = int((starts + lengths).max())
        mask = (torch.arange(span, device=ids.device)[None, None, :] <= positions[:, :, None])[
            :, None
        ]  # [n, 1, L, span]
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        cos, sin = cos[:, None], sin[:, None]  # [n, 1, L, D]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, (n, length, nh, hd), (n, length, kvh, hd))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache.write_tokens(
                i, write_rows, write_pos, k.transpose(1, 2)[valid], v.transpose(1, 2)[valid]
            )
            if i == last and not want_logits:
                return None
            keys, values = cache.k[i][rows, :, :span], cache.v[i][rows, :, :span]
            if self._rep > 1:
                keys = keys.repeat_interleave(self._rep, dim=1)
                values = values.repeat_interleave(self._rep, dim=1)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            h = h + attn.o_proj(a.transpose(1, 2).reshape(n, length, nh * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).float()

    @torch.inference_mode()
    def decode(
        self, cache: SlotKVCache, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One token for each cache row ``0..n-1``: ``ids[i]`` sits at ``positions[i]`` and
        attends to that row's positions ``0..positions[i]``. Returns float32 logits
        ``[n, vocab]``."""
        n = ids.shape[0]
        kvh, hd, rep = self.shape.kv_heads, self.shape.head_dim, self._rep
        span = int(positions.max()) + 1
        h = self.embed(ids[:, None])
        cos, sin = self.rotary(h, positions[:, None])
        cos, sin = cos[:, None], sin[:, None]  # [n, 1, 1, D]
        mask = (torch.arange(span, device=ids.device)[None, :] <= positions[:, None]).view(
            n, 1, 1, span
        )
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            # Grouped queries: the rep query heads sharing a KV head take the query-length
            # axis, so attention reads each KV head once with no repeat_kv copy.
            q, k, v = self._qkv(attn, x, (n, kvh, rep, hd), (n, kvh, 1, hd))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache.write_token(i, n, positions, k[:, :, 0], v[:, :, 0])
            keys, values = cache.view(i, n, span)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            h = h + attn.o_proj(a.reshape(n, 1, kvh * rep * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))[:, 0].float()

    @torch.inference_mode()
    def verify(
        self, cache: SlotKVCache, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Several tokens for each cache row ``0..n-1`` in one forward (speculative
        verification): row ``i`` feeds ``ids[i, :lengths[i]]`` (its last token then its
        draft; right-padded) at positions ``positions[i]`` on, each attending causally to
        the row's cache and the tokens before it. Writes their K/V (padding is not
        written) and returns float32 logits ``[n, L, vocab]``."""
        n, length = ids.shape
        kvh, hd, rep = self.shape.kv_heads, self.shape.head_dim, self._rep
        steps = torch.arange(length, device=ids.device)
        pos = positions[:, None] + steps[None, :]  # [n, L]
        span = int((positions + lengths).max())
        valid = steps[None, :] < lengths[:, None]
        rows_w = torch.arange(n, device=ids.device)[:, None].expand(n, length)[valid]
        pos_w = pos[valid]
        h = self.embed(ids)
        cos, sin = self.rotary(h, pos)  # [n, L, D]
        q_cos, q_sin = cos[:, :, None, None], sin[:, :, None, None]  # over kv heads and rep
        k_cos, k_sin = cos[:, :, None], sin[:, :, None]
        # query (j, r) of KV head g sees key position t if t <= position of query j; the rep
        # query heads of a KV head ride on the query-length axis, as in decode.
        keys_at = torch.arange(span, device=ids.device)
        mask = (keys_at[None, None, :] <= pos[:, :, None]).repeat_interleave(rep, dim=1)
        mask = mask[:, None]  # [n, 1, L * rep, span]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, (n, length, kvh, rep, hd), (n, length, kvh, hd))
            q, k = _rope(q, q_cos, q_sin), _rope(k, k_cos, k_sin)
            cache.write_tokens(i, rows_w, pos_w, k[valid], v[valid])
            keys, values = cache.view(i, n, span)
            q = q.permute(0, 2, 1, 3, 4).reshape(n, kvh, length * rep, hd)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            a = a.view(n, kvh, length, rep, hd).permute(0, 2, 1, 3, 4)
            h = h + attn.o_proj(a.reshape(n, length, kvh * rep * hd))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).float()


def padded_batches(
    items: list[tuple[int, int, np.ndarray]], cap: int
) -> Iterable[list[tuple[int, int, np.ndarray]]]:
    """Prefill items ``(row, start, tokens)`` in order, cut so that each batch's padded
    size (requests x longest) stays within ``cap`` (a longer single item runs alone)."""
    batch: list[tuple[int, int, np.ndarray]] = []
    longest = 0
    for item in items:
        n = len(item[2])
        if batch and (len(batch) + 1) * max(longest, n) > cap:
            yield batch
            batch, longest = [], 0
        batch.append(item)
        longest = max(longest, n)
    if batch:
        yield batch
