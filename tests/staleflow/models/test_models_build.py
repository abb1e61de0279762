"""Presets, model construction, the policy's named weights, and local checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.data.synthetic import ALPHABET  # noqa: E402
from staleflow.models import (  # noqa: E402
    PRESETS,
    ModelError,
    ModelPreset,
    arithmetic_tokenizer,
    build_arithmetic_model,
    build_model,
    get_preset,
    load_policy_state,
    load_pretrained,
    policy_state,
    qwen2_config,
    save_pretrained,
)


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_presets_sizes():
    assert 2_000_000 < PRESETS["tiny"].num_parameters(17) < 6_000_000
    assert PRESETS["micro"].num_parameters(17) < 300_000
    model, tokenizer = build_arithmetic_model("micro")
    assert _params(model) == PRESETS["micro"].num_parameters(tokenizer.vocab_size)
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("huge")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelPreset(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_size=8)


def test_arithmetic_tokenizer_is_the_char_tokenizer_of_the_alphabet():
    tokenizer = arithmetic_tokenizer()
    assert tokenizer.alphabet == ALPHABET and tokenizer.vocab_size == 3 + len(ALPHABET)
    assert tokenizer.decode(tokenizer.encode("12+7*3=")) == "12+7*3="


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_model("micro", 17, seed=5)
    after = torch.rand(3)
    b = build_model("micro", 17, seed=5)
    c = build_model("micro", 17, seed=6)
    assert torch.equal(expected, after)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_build_from_config_and_argument_errors():
    config = qwen2_config("micro", 20, attn_implementation="eager")
    model = build_model(config)
    assert model.config.vocab_size == 20 and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="vocab_size=17 but"):
        build_model(config, 17)
    with pytest.raises(ValueError, match="needs vocab_size"):
        build_model("micro")
    with pytest.raises(ValueError, match="attn_implementation"):
        qwen2_config("micro", 17, attn_implementation="flash")


def test_policy_state_names_tied_weights_once_and_shares_memory():
    model, _ = build_arithmetic_model("micro")
    state = policy_state(model)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    assert list(state) == [name for name, _ in model.named_parameters()]
    assert state["model.norm.weight"].data_ptr() == model.model.norm.weight.data_ptr()
    assert not any(t.requires_grad for t in state.values())


def test_load_policy_state_round_trip_and_errors():
    source, _ = build_arithmetic_model("micro", seed=1)
    target, _ = build_arithmetic_model("micro", seed=2)
    arrays = {k: v.numpy().copy() for k, v in policy_state(source).items()}
    load_policy_state(target, arrays)
    for name, tensor in policy_state(target).items():
        assert np.array_equal(tensor.numpy(), arrays[name]), name
    # tied: the output layer follows the embedding
    assert torch.equal(target.lm_head.weight, source.lm_head.weight)

    before = {k: v.clone() for k, v in policy_state(target).items()}
    bad = dict(arrays)
    bad["model.norm.weight"] = np.zeros(7, np.float32)
    with pytest.raises(ModelError, match=r"'model\.norm\.weight': shape \(7,\)"):
        load_policy_state(target, bad)
    missing = {k: v for k, v in arrays.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelError, match=r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        load_policy_state(target, missing)
    with pytest.raises(ModelError, match=r"unexpected \['lm_head\.weight'\]"):
        load_policy_state(target, {**arrays, "lm_head.weight": arrays["model.embed_tokens.weight"]})
    # nothing was copied by the failed loads
    after = policy_state(target)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_save_and_load_pretrained_round_trip(tmp_path):
    model, tokenizer = build_arithmetic_model("micro", seed=3)
    save_pretrained(model, tokenizer, tmp_path / "ckpt")
    loaded, loaded_tokenizer = load_pretrained(tmp_path / "ckpt")
    assert loaded_tokenizer.alphabet == tokenizer.alphabet
    ids = torch.tensor([[1, 4, 5, 13, 6, 16]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert list(policy_state(loaded)) == list(policy_state(model))


def test_load_pretrained_errors_name_the_problem(tmp_path):
    model, _ = build_arithmetic_model("micro")
    with pytest.raises(ModelError, match="no such checkpoint directory"):
        load_pretrained(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="not a directory"):
        load_pretrained(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"no config\.json"):
        load_pretrained(tmp_path / "empty")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelError, match="has no weights"):
        load_pretrained(tmp_path / "config_only")
    model.save_pretrained(tmp_path / "no_tokenizer")
    with pytest.raises(ModelError, match="has no tokenizer"):
        load_pretrained(tmp_path / "no_tokenizer")


def test_a_checkpoint_without_a_tokenizer_loads_with_one_given_apart(tmp_path):
    model, tokenizer = build_arithmetic_model("micro", seed=3)
    model.save_pretrained(tmp_path / "weights_only")
    tokenizer.save(tmp_path / "tok.json")
    _, loaded_tokenizer = load_pretrained(
        tmp_path / "weights_only", tokenizer_path=tmp_path / "tok.json"
    )
    assert loaded_tokenizer.alphabet == tokenizer.alphabet
    with pytest.raises(ModelError, match="cannot load the tokenizer"):
        load_pretrained(tmp_path / "weights_only", tokenizer_path=tmp_path / "absent.json")


def test_load_pretrained_rejects_a_model_without_a_causal_lm_head(tmp_path):
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=8,
        image_size=4,
        patch_size=2,
    )
    ViTModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="model_type='vit' is not a causal language model"):
        load_pretrained(tmp_path)


def test_models_package_imports_without_torch_for_presets():
    import subprocess
    import sys

    code = (
        "import sys, staleflow.models as m; m.get_preset('tiny'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _qwen2_folder_with_a_classless_tokenizer(folder):
    """A tiny Qwen2 checkpoint whose tokenizer (one id per character, saved by
    PreTrainedTokenizerFast) names no 'tokenizer_class': transformers then loads it by
    config.json's model_type as Qwen2Tokenizer, which adds '<|endoftext|>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<unk>", "</s>", *"abcdefghijklmnopqrstuvwxyz0123456789"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    config = Qwen2Config(
        vocab_size=len(words),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return len(words)


def test_a_tokenizer_beyond_the_embedding_is_refused_naming_the_extra_ids(tmp_path):
    rows = _qwen2_folder_with_a_classless_tokenizer(tmp_path)
    with pytest.raises(ModelError) as err:
        load_pretrained(tmp_path)
    message = str(err.value)
    assert f"has {rows + 1} ids but the model's embedding only {rows} rows" in message
    # where the extra id came from: its token, and the class that added it
    assert f"{rows} '<|endoftext|>' (an added special token of Qwen2Tokenizer)" in message
    # and the fix
    assert "data.tokenizer=" in message and "resize_token_embeddings" in message
