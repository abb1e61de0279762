"""Converters: Megatron-core TP shards -> HF names, checked against shards built by hand."""

from __future__ import annotations

import numpy as np
import pytest

from parameter_server.convert import GPTConfig, IdentityConverter, MegatronToHF
from parameter_server.errors import LayoutError, LayoutMismatchError
from parameter_server.layout import Layout
from parameter_server.store import VersionedStore

LLAMA_GQA = GPTConfig(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=24,
    vocab_size=40,
    hf_vocab_size=37,
)
QWEN2_MHA_TIED = GPTConfig(
    num_layers=1,
    hidden_size=12,
    num_attention_heads=4,
    num_query_groups=4,
    ffn_hidden_size=8,
    vocab_size=16,
    qkv_bias=True,
    tie_word_embeddings=True,
    te_fused_layernorm=False,
)
QWEN3_MQA = GPTConfig(
    num_layers=1,
    hidden_size=8,
    num_attention_heads=4,
    num_query_groups=1,
    ffn_hidden_size=8,
    vocab_size=8,
    kv_channels=3,
    qk_layernorm=True,
)


def hf_reference(conv: MegatronToHF) -> dict[str, np.ndarray]:
    """HF tensors whose every element is distinct, so any misplacement shows."""
    out, start = {}, 0
    for spec in conv.target_layout:
        n = int(np.prod(spec.shape))
        out[spec.name] = np.arange(start, start + n, dtype=np.float32).reshape(spec.shape)
        start += n
    return out


def megatron_by_hand(c: GPTConfig, tp: int, hf: dict[str, np.ndarray]) -> list[dict]:
    """What each TP rank of Megatron-core holds, written out head by head."""
    hd, hpg = c.head_dim, c.num_attention_heads // c.num_query_groups
    groups_per_rank = c.num_query_groups // tp
    ffn = c.ffn_hidden_size // tp
    vocab = c.vocab_size // tp
    ranks = []
    for r in range(tp):
        sd: dict[str, np.ndarray] = {}

        def vocab_rows(w: np.ndarray, r: int = r) -> np.ndarray:
            rows = [
                w[i] if i < w.shape[0] else np.full(w.shape[1], -7.0, np.float32)
                for i in range(r * vocab, (r + 1) * vocab)
            ]
            return np.stack(rows).astype(np.float32)

        def fused_qkv(p: str, kind: str, r: int = r) -> np.ndarray:
            q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
            rows = []
            for g in range(r * groups_per_rank, (r + 1) * groups_per_rank):
                for head in range(g * hpg, (g + 1) * hpg):
                    rows.extend(q[head * hd + i] for i in range(hd))
                rows.extend(k[g * hd + i] for i in range(hd))
                rows.extend(v[g * hd + i] for i in range(hd))
            return np.stack(rows)

        sd["embedding.word_embeddings.weight"] = vocab_rows(hf["model.embed_tokens.weight"])
        for i in range(c.num_layers):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            if c.te_fused_layernorm:
                ln1 = m + "self_attention.linear_qkv.layer_norm_weight"
                ln2 = m + "mlp.linear_fc1.layer_norm_weight"
            else:
                ln1, ln2 = m + "input_layernorm.weight", m + "pre_mlp_layernorm.weight"
            sd[ln1] = hf[p + "input_layernorm.weight"]
            sd[m + "self_attention.linear_qkv.weight"] = fused_qkv(p, "weight")
            if c.qkv_bias:
                sd[m + "self_attention.linear_qkv.bias"] = fused_qkv(p, "bias")
            if c.qk_layernorm:
                sd[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
                sd[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
            cols = c.num_attention_heads * hd // tp
            o = hf[p + "self_attn.o_proj.weight"]
            sd[m + "self_attention.linear_proj.weight"] = o[:, r * cols : (r + 1) * cols]
            sd[ln2] = hf[p + "post_attention_layernorm.weight"]
            gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
            sd[m + "mlp.linear_fc1.weight"] = np.vstack(
                [gate[r * ffn : (r + 1) * ffn], up[r * ffn : (r + 1) * ffn]]
            )
            sd[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][
                :, r * ffn : (r + 1) * ffn
            ]
        sd["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not c.tie_word_embeddings:
            sd["output_layer.weight"] = vocab_rows(hf["lm_head.weight"])
        ranks.append(sd)
    return ranks


CASES = [(LLAMA_GQA, 1), (LLAMA_GQA, 2), (QWEN2_MHA_TIED, 2), (QWEN2_MHA_TIED, 4), (QWEN3_MQA, 1)]


@pytest.mark.parametrize(("config", "tp"), CASES)
def test_megatron_shards_gather_to_hf(config: GPTConfig, tp: int) -> None:
    conv = MegatronToHF(config, tp)
    hf = hf_reference(conv)
    shards = megatron_by_hand(config, tp, hf)
    out = conv.convert(shards)
    assert list(out) == list(hf)
    for name, ref in hf.items():
        np.testing.assert_array_equal(out[name], ref, err_msg=name)


@pytest.mark.parametrize(("config", "tp"), CASES)
def test_split_is_the_inverse_of_convert(config: GPTConfig, tp: int) -> None:
    conv = MegatronToHF(config, tp)
    hf = hf_reference(conv)
    shards = conv.split(hf)
    by_hand = megatron_by_hand(config, tp, hf)
    for rank, (got, want) in enumerate(zip(shards, by_hand, strict=True)):
        assert list(got) == list(conv.shard_layout.names)
        for name in want:
            keep = slice(None)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                vocab_rows = config.vocab_size // tp
                keep = slice(
                    0, max(0, (config.hf_vocab_size or config.vocab_size) - rank * vocab_rows)
                )
            np.testing.assert_array_equal(got[name][keep], want[name][keep], err_msg=name)
    round_trip = conv.convert(shards)
    for name, ref in hf.items():
        np.testing.assert_array_equal(round_trip[name], ref)


def test_hf_names_match_a_llama_state_dict() -> None:
    names = MegatronToHF(LLAMA_GQA, 2).target_layout.names
    assert names[:6] == (
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    )
    assert names[-2:] == ("model.norm.weight", "lm_head.weight")
    layout = MegatronToHF(LLAMA_GQA, 2).target_layout
    assert layout.spec("model.layers.1.self_attn.k_proj.weight").shape == (8, 16)
    assert layout.spec("model.embed_tokens.weight").shape == (37, 16)


def test_convert_into_a_store_slot_needs_no_extra_buffer() -> None:
    conv = MegatronToHF(LLAMA_GQA, 2)
    hf = hf_reference(conv)
    store = VersionedStore(conv.target_layout)
    with store.begin_push() as lease:
        conv.convert_into(megatron_by_hand(LLAMA_GQA, 2, hf), conv.target_layout.views(lease.view))
    dest = np.empty(conv.target_layout.nbytes, np.uint8)
    store.pull(dest)
    np.testing.assert_array_equal(
        conv.target_layout.views(dest)["model.layers.1.self_attn.v_proj.weight"],
        hf["model.layers.1.self_attn.v_proj.weight"],
    )


def test_bad_shards_are_rejected_with_the_rank_named() -> None:
    conv = MegatronToHF(LLAMA_GQA, 2)
    shards = megatron_by_hand(LLAMA_GQA, 2, hf_reference(conv))
    with pytest.raises(LayoutMismatchError, match="expected 2"):
        conv.convert(shards[:1])
    broken = [dict(shards[0]), dict(shards[1])]
    del broken[1]["decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(LayoutMismatchError, match=r"TP rank 1.*linear_fc2"):
        conv.convert(broken)
    diverged = [dict(shards[0]), dict(shards[1])]
    diverged[1]["decoder.final_layernorm.weight"] = (
        diverged[1]["decoder.final_layernorm.weight"] + 1
    )
    with pytest.raises(LayoutMismatchError, match="differs between TP rank 0 and 1"):
        conv.convert(diverged)


def test_impossible_parallel_configs_are_rejected() -> None:
    with pytest.raises(LayoutError, match=r"num_query_groups .* divisible"):
        MegatronToHF(LLAMA_GQA, 4)
    with pytest.raises(LayoutError, match="multiple of"):
        GPTConfig(1, 8, num_attention_heads=3, num_query_groups=2, ffn_hidden_size=4, vocab_size=4)


def test_identity_converter_validates_and_copies() -> None:
    layout = Layout.from_arrays({"w": np.zeros((2, 3), np.float32)})
    conv = IdentityConverter(layout)
    src = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    out = layout.views(np.zeros(layout.nbytes, np.uint8))
    conv.convert_into(src, out)
    np.testing.assert_array_equal(out["w"], src["w"])
    with pytest.raises(LayoutMismatchError):
        conv.convert({"w": np.zeros((3, 2), np.float32)})


def test_torch_bfloat16_round_trip_through_the_store() -> None:
    torch = pytest.importorskip("torch")
    from parameter_server.torch_compat import (
        layout_of_state_dict,
        state_dict_to_numpy,
        views_to_torch,
    )

    sd = {"w": torch.randn(4, 5).to(torch.bfloat16), "b": torch.randn(3)}
    layout = layout_of_state_dict(sd)
    assert layout.spec("w").dtype == "bfloat16"
    store = VersionedStore(layout)
    store.push(state_dict_to_numpy(sd))
    dest = np.empty(layout.nbytes, np.uint8)
    store.pull(dest)
    back = views_to_torch(layout, dest)
    assert back["w"].dtype == torch.bfloat16
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])
