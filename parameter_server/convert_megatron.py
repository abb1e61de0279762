"""Megatron-core tensor-parallel GPT shards <-> Hugging Face names (Llama / Qwen2 / Qwen3).

What each Megatron tensor holds on TP rank ``r`` of ``t`` (see
megatron/core/transformer/attention.py and Megatron-LM's tools/checkpoint savers):

- ``linear_qkv`` (column parallel): the rank's ``ng / t`` query groups, and for
  each group its ``np / ng`` query heads, then one key head, then one value
  head, each ``head_dim`` rows. Concatenating ranks gives all groups in order,
  so un-interleaving per group recovers q, k and v.
- ``linear_fc1`` (column parallel, gated): ``[gate_r; up_r]``, the rank's rows
  of gate_proj followed by its rows of up_proj.
- ``linear_proj`` and ``linear_fc2`` (row parallel): split along columns.
- ``word_embeddings`` / ``output_layer`` (vocab parallel): split along rows; the
  padded vocabulary is trimmed to the HF size.
- layernorms are replicated; with Transformer Engine they are fused into the
  next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).

Pipeline parallelism is out of scope here: give the converter the stages'
shards already renumbered to global layer indices.

The inverse (:meth:`MegatronToHF.shard`, :meth:`MegatronToHF.split`) is how a trainer rank
loads its shard from an HF checkpoint or a PS version; :func:`gpt_config_from_hf` reads
the shape from an HF ``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from parameter_server.errors import LayoutError, LayoutMismatchError
from parameter_server.layout import Layout, ParamSpec


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a Llama/Qwen-style decoder, in Megatron's terms."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    """Megatron's (padded) vocabulary size."""
    hf_vocab_size: int | None = None
    """The HF vocabulary size, if padding rows must be trimmed."""
    kv_channels: int | None = None
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    te_fused_layernorm: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise LayoutError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise LayoutError(
                "hidden_size is not divisible by num_attention_heads; set kv_channels"
            )
        if self.hf_vocab_size is not None and self.hf_vocab_size > self.vocab_size:
            raise LayoutError("hf_vocab_size cannot exceed the padded vocab_size")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


class MegatronToHF:
    """Gathers Megatron-core TP shards of a GPT into Hugging Face parameters."""

    def __init__(self, config: GPTConfig, tp_size: int) -> None:
        c = config
        for what, n in (
            ("num_query_groups", c.num_query_groups),
            ("ffn_hidden_size", c.ffn_hidden_size),
            ("vocab_size", c.vocab_size),
        ):
            if tp_size < 1 or n % tp_size:
                raise LayoutError(f"{what} ({n}) must be divisible by tensor parallel {tp_size}")
        self.config = config
        self.tp_size = tp_size
        self._shard_layout = Layout(self._shard_specs())
        self._hf_layout = Layout(self._hf_specs())

    @property
    def target_layout(self) -> Layout:
        return self._hf_layout

    @property
    def shard_layout(self) -> Layout:
        """Names, shapes and dtypes every TP rank must export."""
        return self._shard_layout

    # -- specs ----------------------------------------------------------------------

    def _ln_names(self, i: int) -> tuple[str, str]:
        p = f"decoder.layers.{i}."
        if self.config.te_fused_layernorm:
            return (
                p + "self_attention.linear_qkv.layer_norm_weight",
                p + "mlp.linear_fc1.layer_norm_weight",
            )
        return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"

    def _shard_specs(self) -> list[ParamSpec]:
        c, t, d = self.config, self.tp_size, self.config.dtype
        h, hd = c.hidden_size, c.head_dim
        qkv_rows = c.num_query_groups // t * (c.heads_per_group + 2) * hd
        specs = [ParamSpec("embedding.word_embeddings.weight", (c.vocab_size // t, h), d)]
        for i in range(c.num_layers):
            p = f"decoder.layers.{i}."
            ln_attn, ln_mlp = self._ln_names(i)
            specs.append(ParamSpec(ln_attn, (h,), d))
            specs.append(ParamSpec(p + "self_attention.linear_qkv.weight", (qkv_rows, h), d))
            if c.qkv_bias:
                specs.append(ParamSpec(p + "self_attention.linear_qkv.bias", (qkv_rows,), d))
            if c.qk_layernorm:
                specs.append(ParamSpec(p + "self_attention.q_layernorm.weight", (hd,), d))
                specs.append(ParamSpec(p + "self_attention.k_layernorm.weight", (hd,), d))
            proj_cols = c.num_attention_heads * hd // t
            specs.append(ParamSpec(p + "self_attention.linear_proj.weight", (h, proj_cols), d))
            specs.append(ParamSpec(ln_mlp, (h,), d))
            ffn = c.ffn_hidden_size // t
            specs.append(ParamSpec(p + "mlp.linear_fc1.weight", (2 * ffn, h), d))
            specs.append(ParamSpec(p + "mlp.linear_fc2.weight", (h, ffn), d))
        specs.append(ParamSpec("decoder.final_layernorm.weight", (h,), d))
        if not c.tie_word_embeddings:
            specs.append(ParamSpec("output_layer.weight", (c.vocab_size // t, h), d))
        return specs

    def _hf_specs(self) -> list[ParamSpec]:
        c, d = self.config, self.config.dtype
        h, hd, vocab = c.hidden_size, c.head_dim, c.hf_vocab_size or c.vocab_size
        q, kv = c.num_attention_heads * hd, c.num_query_groups * hd
        specs = [ParamSpec("model.embed_tokens.weight", (vocab, h), d)]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            specs.append(ParamSpec(p + "input_layernorm.weight", (h,), d))
            for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                specs.append(ParamSpec(f"{p}self_attn.{proj}_proj.weight", (rows, h), d))
                if c.qkv_bias:
                    specs.append(ParamSpec(f"{p}self_attn.{proj}_proj.bias", (rows,), d))
            if c.qk_layernorm:
                specs.append(ParamSpec(p + "self_attn.q_norm.weight", (hd,), d))
                specs.append(ParamSpec(p + "self_attn.k_norm.weight", (hd,), d))
            specs.append(ParamSpec(p + "self_attn.o_proj.weight", (h, q), d))
            specs.append(ParamSpec(p + "post_attention_layernorm.weight", (h,), d))
            specs.append(ParamSpec(p + "mlp.gate_proj.weight", (c.ffn_hidden_size, h), d))
            specs.append(ParamSpec(p + "mlp.up_proj.weight", (c.ffn_hidden_size, h), d))
            specs.append(ParamSpec(p + "mlp.down_proj.weight", (h, c.ffn_hidden_size), d))
        specs.append(ParamSpec("model.norm.weight", (h,), d))
        if not c.tie_word_embeddings:
            specs.append(ParamSpec("lm_head.weight", (vocab, h), d))
        return specs

    # -- conversion -----------------------------------------------------------------

    def convert(self, shards: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Gather ``shards`` (one mapping per TP rank, in rank order) into HF tensors."""
        buffer = np.empty(self._hf_layout.nbytes, dtype=np.uint8)
        out = self._hf_layout.views(buffer)
        self.convert_into(shards, out)
        return out

    def convert_into(
        self, shards: Sequence[Mapping[str, np.ndarray]], out: Mapping[str, np.ndarray]
    ) -> None:
        """Like :meth:`convert`, writing into existing HF-named arrays (e.g. a PS slot)."""
        if len(shards) != self.tp_size:
            raise LayoutMismatchError(
                f"got {len(shards)} TP shards, expected {self.tp_size}; pass every rank's "
                "state dict in rank order"
            )
        for rank, shard in enumerate(shards):
            try:
                self._shard_layout.validate(shard)
            except LayoutMismatchError as exc:
                raise LayoutMismatchError(f"TP rank {rank}: {exc}") from None
        self._hf_layout.validate(out)
        if not all(a.flags.c_contiguous for a in out.values()):
            raise LayoutMismatchError(
                "convert_into needs C-contiguous output arrays (Layout.views)"
            )
        c = self.config
        self._vocab_rows(
            shards, "embedding.word_embeddings.weight", out["model.embed_tokens.weight"]
        )
        for i in range(c.num_layers):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            ln_attn, ln_mlp = self._ln_names(i)
            self._replicated(shards, ln_attn, out[p + "input_layernorm.weight"])
            self._replicated(shards, ln_mlp, out[p + "post_attention_layernorm.weight"])
            self._qkv(shards, m + "self_attention.linear_qkv.weight", out, p, "weight")
            if c.qkv_bias:
                self._qkv(shards, m + "self_attention.linear_qkv.bias", out, p, "bias")
            if c.qk_layernorm:
                self._replicated(
                    shards,
                    m + "self_attention.q_layernorm.weight",
                    out[p + "self_attn.q_norm.weight"],
                )
                self._replicated(
                    shards,
                    m + "self_attention.k_layernorm.weight",
                    out[p + "self_attn.k_norm.weight"],
                )
            self._columns(
                shards, m + "self_attention.linear_proj.weight", out[p + "self_attn.o_proj.weight"]
            )
            self._gate_up(
                shards,
                m + "mlp.linear_fc1.weight",
                out[p + "mlp.gate_proj.weight"],
                out[p + "mlp.up_proj.weight"],
            )
            self._columns(shards, m + "mlp.linear_fc2.weight", out[p + "mlp.down_proj.weight"])
        self._replicated(shards, "decoder.final_layernorm.weight", out["model.norm.weight"])
        if not c.tie_word_embeddings:
            self._vocab_rows(shards, "output_layer.weight", out["lm_head.weight"])

    def _replicated(
        self, shards: Sequence[Mapping[str, np.ndarray]], name: str, dest: np.ndarray
    ) -> None:
        first = shards[0][name]
        for rank in range(1, len(shards)):
            if not np.array_equal(shards[rank][name], first):
                raise LayoutMismatchError(
                    f"{name} differs between TP rank 0 and {rank}; replicated parameters must be "
                    "identical on every rank (is the trainer's TP group in sync?)"
                )
        np.copyto(dest, first.view(dest.dtype))

    def _vocab_rows(
        self, shards: Sequence[Mapping[str, np.ndarray]], name: str, dest: np.ndarray
    ) -> None:
        rows = self.config.vocab_size // self.tp_size
        keep = dest.shape[0]
        for rank, shard in enumerate(shards):
            lo = rank * rows
            n = max(0, min(rows, keep - lo))
            if n:
                np.copyto(dest[lo : lo + n], shard[name][:n].view(dest.dtype))

    def _columns(
        self, shards: Sequence[Mapping[str, np.ndarray]], name: str, dest: np.ndarray
    ) -> None:
        cols = dest.shape[1] // self.tp_size
        for rank, shard in enumerate(shards):
            np.copyto(dest[:, rank * cols : (rank + 1) * cols], shard[name].view(dest.dtype))

    def _gate_up(
        self,
        shards: Sequence[Mapping[str, np.ndarray]],
        name: str,
        gate: np.ndarray,
        up: np.ndarray,
    ) -> None:
        rows = gate.shape[0] // self.tp_size
        for rank, shard in enumerate(shards):
            w = shard[name].view(gate.dtype)
            np.copyto(gate[rank * rows : (rank + 1) * rows], w[:rows])
            np.copyto(up[rank * rows : (rank + 1) * rows], w[rows:])

    def _qkv(
        self,
        shards: Sequence[Mapping[str, np.ndarray]],
        name: str,
        out: Mapping[str, np.ndarray],
        prefix: str,
        kind: str,
    ) -> None:
        c = self.config
        hd, hpg = c.head_dim, c.heads_per_group
        groups = c.num_query_groups // self.tp_size
        q = out[f"{prefix}self_attn.q_proj.{kind}"]
        k = out[f"{prefix}self_attn.k_proj.{kind}"]
        v = out[f"{prefix}self_attn.v_proj.{kind}"]
        tail = q.shape[1:]  # (hidden,) for weights, () for biases
        q_g = q.reshape(c.num_query_groups, hpg * hd, *tail)
        k_g = k.reshape(c.num_query_groups, hd, *tail)
        v_g = v.reshape(c.num_query_groups, hd, *tail)
        for rank, shard in enumerate(shards):
            w = shard[name].view(q.dtype).reshape(groups, (hpg + 2) * hd, *tail)
            g = slice(rank * groups, (rank + 1) * groups)
            np.copyto(q_g[g], w[:, : hpg * hd])
            np.copyto(k_g[g], w[:, hpg * hd : (hpg + 1) * hd])
            np.copyto(v_g[g], w[:, (hpg + 1) * hd :])

    # -- inverse: HF -> Megatron ------------------------------------------------------

    def split(self, hf: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """HF tensors -> one Megatron state dict per TP rank (the inverse of :meth:`convert`)."""
        self._hf_layout.validate(hf)
        return [self._shard(hf, rank) for rank in range(self.tp_size)]

    def shard(self, hf: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        """TP rank ``rank``'s Megatron state dict of the HF tensors ``hf``: what one rank
        loads from an HF checkpoint or a PS version. Padding rows of a padded vocabulary
        are zero; the arrays are fresh copies."""
        if not 0 <= rank < self.tp_size:
            raise LayoutError(f"TP rank {rank} is outside [0, {self.tp_size})")
        self._hf_layout.validate(hf)
        return self._shard(hf, rank)

    def _shard(self, hf: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        c, t = self.config, self.tp_size
        hd, hpg = c.head_dim, c.heads_per_group
        g = slice(rank * (c.num_query_groups // t), (rank + 1) * (c.num_query_groups // t))
        ffn = c.ffn_hidden_size // t
        vocab_rows = c.vocab_size // t

        def vocab(src: np.ndarray) -> np.ndarray:
            out = np.zeros((vocab_rows, c.hidden_size), dtype=src.dtype)
            part = src[rank * vocab_rows : (rank + 1) * vocab_rows]
            out[: part.shape[0]] = part
            return out

        def qkv(p: str, kind: str) -> np.ndarray:
            q = hf[f"{p}self_attn.q_proj.{kind}"]
            tail = q.shape[1:]
            parts = (
                q.reshape(c.num_query_groups, hpg * hd, *tail)[g],
                hf[f"{p}self_attn.k_proj.{kind}"].reshape(c.num_query_groups, hd, *tail)[g],
                hf[f"{p}self_attn.v_proj.{kind}"].reshape(c.num_query_groups, hd, *tail)[g],
            )
            return np.concatenate(parts, axis=1).reshape(-1, *tail)

        sd: dict[str, np.ndarray] = {}
        sd["embedding.word_embeddings.weight"] = vocab(hf["model.embed_tokens.weight"])
        for i in range(c.num_layers):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            ln_attn, ln_mlp = self._ln_names(i)
            sd[ln_attn] = hf[p + "input_layernorm.weight"].copy()
            sd[m + "self_attention.linear_qkv.weight"] = qkv(p, "weight")
            if c.qkv_bias:
                sd[m + "self_attention.linear_qkv.bias"] = qkv(p, "bias")
            if c.qk_layernorm:
                sd[m + "self_attention.q_layernorm.weight"] = hf[
                    p + "self_attn.q_norm.weight"
                ].copy()
                sd[m + "self_attention.k_layernorm.weight"] = hf[
                    p + "self_attn.k_norm.weight"
                ].copy()
            cols = c.num_attention_heads * hd // t
            o = hf[p + "self_attn.o_proj.weight"]
            sd[m + "self_attention.linear_proj.weight"] = o[
                :, rank * cols : (rank + 1) * cols
            ].copy()
            sd[ln_mlp] = hf[p + "post_attention_layernorm.weight"].copy()
            rows = slice(rank * ffn, (rank + 1) * ffn)
            sd[m + "mlp.linear_fc1.weight"] = np.concatenate(
                (hf[p + "mlp.gate_proj.weight"][rows], hf[p + "mlp.up_proj.weight"][rows])
            )
            sd[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][:, rows].copy()
        sd["decoder.final_layernorm.weight"] = hf["model.norm.weight"].copy()
        if not c.tie_word_embeddings:
            sd["output_layer.weight"] = vocab(hf["lm_head.weight"])
        return {name: sd[name] for name in self._shard_layout.names}

    # -- staging: every rank's shards side by side (a sharded Push) ---------------------

    def staging_layout(self) -> Layout:
        """All TP ranks' shards in one layout, rank ``r``'s names prefixed ``tp{r}/``: the
        buffer a PS gathers a sharded Push into before :meth:`convert_into`."""
        return Layout(
            ParamSpec(f"tp{r}/{spec.name}", spec.shape, spec.dtype)
            for r in range(self.tp_size)
            for spec in self._shard_layout
        )

    def staging_shards(self, views: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The per-rank state dicts inside staging ``views`` (``staging_layout().views``)."""
        return [
            {name: views[f"tp{r}/{name}"] for name in self._shard_layout.names}
            for r in range(self.tp_size)
        ]


# Hugging Face architectures whose decoder layers are Megatron's GPT layers with RMSNorm,
# rotary embeddings and a SwiGLU MLP; what differs is in :func:`gpt_config_from_hf`.
HF_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3")


def pipeline_stage(name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage (of ``pp`` equal ones over ``num_layers`` layers) that holds the
    Megatron parameter ``name`` (global layer numbers): the embedding on the first, the
    final norm and output layer on the last, each layer on the stage its number falls in."""
    if num_layers % pp:
        raise LayoutError(f"{num_layers} layers do not split into {pp} equal pipeline stages")
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (num_layers // pp)
    return pp - 1


def unsupported_hf(hf: Mapping[str, Any]) -> str:
    """Why the HF config ``hf`` (``config.json`` as a dict) has no Megatron layout here;
    '' when it has one."""
    kind = hf.get("model_type")
    if kind not in HF_MODEL_TYPES:
        return f"model_type {kind!r} is not one of {', '.join(HF_MODEL_TYPES)}"
    if hf.get("hidden_act", "silu") != "silu":
        return f"hidden_act {hf.get('hidden_act')!r} is not silu (SwiGLU)"
    if hf.get("mlp_bias"):
        return "mlp_bias=true (biased MLP projections)"
    if hf.get("use_sliding_window"):
        return "use_sliding_window=true (sliding-window attention)"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else "?"
    if rope_kind not in ("default", None):
        return f"rope_type {rope_kind!r} (only plain rotary embeddings)"
    return ""


def gpt_config_from_hf(
    hf: Mapping[str, Any], tp: int = 1, *, dtype: str = "float32", vocab_multiple: int = 128
) -> GPTConfig:
    """The Megatron shape of a Llama / Qwen2 / Qwen3 HF config (``config.json`` as a
    dict) at tensor parallelism ``tp``: the vocabulary padded to a multiple of
    ``vocab_multiple * tp`` (Megatron's ``make_vocab_size_divisible_by``), Qwen2's QKV
    bias, Qwen3's per-head q/k norms, the local (non-TE) layer spec's layernorm names."""
    why = unsupported_hf(hf)
    if why:
        raise LayoutError(f"no Megatron layout for this model: {why}")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    vocab = int(hf["vocab_size"])
    step = vocab_multiple * tp
    head_dim = hf.get("head_dim") or hidden // heads
    kind = hf["model_type"]
    return GPTConfig(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        vocab_size=(vocab + step - 1) // step * step,
        hf_vocab_size=vocab,
        kv_channels=int(head_dim),
        qkv_bias=kind == "qwen2" or bool(hf.get("attention_bias")),
        qk_layernorm=kind == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        te_fused_layernorm=False,
        dtype=dtype,
    )
