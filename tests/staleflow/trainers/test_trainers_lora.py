"""The embedded trainer with ``trainer.lora``: it trains the adapter alone on frozen
weights (with the one shared RL step), exports the adapter per version and the base once,
and its checkpoint keeps both (the merged policy loads in transformers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.config.lora import LoraConfig  # noqa: E402
from staleflow.models import ModelError, build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models import lora as lora_lib  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from tests.staleflow.trainers.test_trainers_embedded import (  # noqa: E402
    BAD,
    GOOD,
    PROMPT,
    _batch,
    _response_logprobs,
)

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj")


def _setup(seed=0, lora=LORA, **config):
    model, tokenizer = build_arithmetic_model("micro", seed=seed)
    trainer = EmbeddedTrainer(
        model,
        TrainerConfig(**{"lr": 3e-2, "lora": lora, **config}),
        pad_id=tokenizer.pad_id,
        tokenizer=tokenizer,
        seed=seed,
    )
    return model, tokenizer, trainer


def test_the_adapter_learns_and_the_base_stays_frozen():
    model, tokenizer, trainer = _setup()
    base = {k: v.clone() for k, v in lora_lib.base_state(model).items()}
    before = {t: _response_logprobs(model, tokenizer, PROMPT, t).sum() for t in (GOOD, *BAD)}
    for _ in range(4):
        trainer.train_step(_batch(model, tokenizer, version=trainer.version))
    after = {t: _response_logprobs(model, tokenizer, PROMPT, t).sum() for t in (GOOD, *BAD)}
    assert after[GOOD] > before[GOOD] + 0.5
    assert sum(after[b] for b in BAD) < sum(before[b] for b in BAD)
    assert all(torch.equal(base[k], v) for k, v in lora_lib.base_state(model).items())
    # only the adapters are in the optimizer: 2 layers x 3 targets x (A, B)
    assert len(trainer._params) == 12
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def test_a_fresh_adapter_leaves_the_policy_as_it_was():
    plain, tokenizer = build_arithmetic_model("micro", seed=0)
    model, _, _ = _setup()
    for text in (GOOD, *BAD):
        np.testing.assert_allclose(
            _response_logprobs(model, tokenizer, PROMPT, text),
            _response_logprobs(plain, tokenizer, PROMPT, text),
            atol=1e-6,
        )


def test_versions_carry_the_adapter_and_the_base_is_exported_apart():
    plain, _ = build_arithmetic_model("micro", seed=0)
    model, tokenizer, trainer = _setup()
    trainer.train_step(_batch(model, tokenizer))
    adapter = trainer.export_weights()
    assert all(n.startswith("base_model.model.") and ".lora_" in n for n in adapter)
    assert len(adapter) == 12
    q = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert q.shape == (4, 32)
    assert adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)
    base = trainer.export_base_weights()
    # the base keeps the names of the model without adapters: a plain model loads it
    assert set(base) == set(policy_state(plain))
    # exports are copies: the next step leaves them as they were
    kept = q.copy()
    trainer.train_step(_batch(model, tokenizer, version=1))
    assert not np.array_equal(trainer.export_weights()[next(iter(adapter))], kept)
    assert np.array_equal(q, kept)


def test_full_weight_trainers_have_no_base_export():
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    trainer = EmbeddedTrainer(model, TrainerConfig(), pad_id=tokenizer.pad_id)
    with pytest.raises(ValueError, match=r"trainer.lora.enabled=false"):
        trainer.export_base_weights()


def test_the_checkpoint_holds_the_merged_policy_the_adapter_and_the_base(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer, trainer = _setup()
    for v in range(2):
        trainer.train_step(_batch(model, tokenizer, version=v))
    trainer.save_checkpoint(tmp_path / "ck")
    ck = tmp_path / "ck"
    config = json.loads((ck / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    # the folder's own weights are the trained policy, merged: transformers loads them
    merged = AutoModelForCausalLM.from_pretrained(ck, local_files_only=True).eval()
    ids = torch.tensor([tokenizer.encode(PROMPT + GOOD, add_bos=True).tolist()])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits)

    # a new trainer resumes the same adapter on the same base, at the same version
    model2, _, trainer2 = _setup(seed=7)  # other initial weights, overwritten by the load
    trainer2.load_checkpoint(ck)
    assert trainer2.version == 2
    for name, value in trainer.export_weights().items():
        np.testing.assert_array_equal(trainer2.export_weights()[name], value)
    for name, value in trainer.export_base_weights().items():
        np.testing.assert_array_equal(trainer2.export_base_weights()[name], value)
    m1 = trainer.train_step(_batch(model, tokenizer, version=2))
    m2 = trainer2.train_step(_batch(model2, tokenizer, version=2))
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-6)


def test_a_full_weight_checkpoint_does_not_resume_a_lora_trainer(tmp_path):
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    EmbeddedTrainer(model, TrainerConfig(), pad_id=tokenizer.pad_id).save_checkpoint(tmp_path)
    _, _, trainer = _setup()
    with pytest.raises(FileNotFoundError, match=r"not a LoRA trainer checkpoint.*model.checkpoint"):
        trainer.load_checkpoint(tmp_path)


def test_a_target_module_the_model_lacks_is_refused_naming_its_layers():
    model, _ = build_arithmetic_model("micro", seed=0)
    bad = LoraConfig(enabled=True, target_modules="q_proj,c_attn")
    with pytest.raises(ModelError, match=r"no linear layer named c_attn.*down_proj,gate_proj"):
        lora_lib.check_targets(model, bad)
    with pytest.raises(ModelError, match="c_attn"):
        EmbeddedTrainer(model, TrainerConfig(lora=bad), pad_id=0)


def test_lora_dropout_acts_in_the_gradient_pass_only():
    model, tokenizer, trainer = _setup(lora=LoraConfig(enabled=True, rank=4, dropout=0.5))
    trainer.train_step(_batch(model, tokenizer))  # B leaves zero: dropout shows in outputs
    ids = torch.tensor([tokenizer.encode(PROMPT + GOOD, add_bos=True).tolist()])
    backend = trainer._backend
    model.eval()
    with torch.no_grad():
        a, b = backend.logits(ids), backend.logits(ids)
    torch.testing.assert_close(a, b)  # no-grad passes (proximal, reference) never drop
    with torch.enable_grad():
        c, d = backend.logits(ids), backend.logits(ids)
    assert not torch.allclose(c, d)
    assert not any(m.training for m in lora_lib.dropout_modules(model))


def test_a_run_resumes_the_checkpoints_base_and_adapter_or_refuses_with_the_fix(tmp_path):
    """What the driver does at start (``with_adapters``): a LoRA checkpoint's folder loads
    as its merged policy; the run takes its exact base and adapter from it."""
    from staleflow.models import load_pretrained

    model, tokenizer, trainer = _setup()
    trainer.train_step(_batch(model, tokenizer))
    trainer.save_checkpoint(tmp_path / "lora")
    policy, _ = load_pretrained(tmp_path / "lora")  # merged weights
    lora_lib.with_adapters(policy, LORA, seed=3, checkpoint=tmp_path / "lora")
    for name, value in trainer.export_weights().items():
        np.testing.assert_array_equal(lora_lib.adapter_state(policy)[name].numpy(), value)
    for name, value in trainer.export_base_weights().items():
        np.testing.assert_array_equal(lora_lib.base_state(policy)[name].numpy(), value)

    plain, tokenizer = build_arithmetic_model("micro", seed=0)
    EmbeddedTrainer(plain, TrainerConfig(), pad_id=0, tokenizer=tokenizer).save_checkpoint(
        tmp_path / "full"
    )
    policy, _ = load_pretrained(tmp_path / "full")
    with pytest.raises(ModelError, match=r"not a LoRA checkpoint.*trainer.lora.enabled=false"):
        lora_lib.with_adapters(policy, LORA, checkpoint=tmp_path / "full")


def test_the_exported_adapter_folder_loads_in_peft_over_the_base(tmp_path):
    """Export offers both: the checkpoint folder is the merged policy, and its adapter/
    folder loads with peft over the base model (as vLLM and SGLang load it)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model, tokenizer, trainer = _setup()
    trainer.train_step(_batch(model, tokenizer))
    trainer.save_checkpoint(tmp_path / "ck")
    base, _ = build_arithmetic_model("micro", seed=11)
    base.load_state_dict(
        load_file(str(tmp_path / "ck" / "base" / "model.safetensors")), strict=False
    )
    served = PeftModel.from_pretrained(base, tmp_path / "ck" / "adapter").eval()
    ids = torch.tensor([tokenizer.encode(PROMPT + GOOD, add_bos=True).tolist()])
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, model(input_ids=ids).logits)
