"""The embedded engine with LoRA adapters (``trainer.lora``): the base arrives once, each
version is the adapter alone, and after a LoRA step the engine's logprobs of what it
samples equal the trainer's and a merged model's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.config.lora import LoraConfig  # noqa: E402
from staleflow.engines.base import GenerationRequest  # noqa: E402
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, load_policy_state  # noqa: E402
from staleflow.models import lora as lora_lib  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from tests.staleflow.trainers.test_trainers_embedded import _batch  # noqa: E402

LORA = LoraConfig(enabled=True, rank=4, alpha=16.0)  # every linear layer of the block
T = 0.7  # a temperature other than 1: logprobs are of softmax(logits / T)


def _trained():
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    trainer = EmbeddedTrainer(
        model,
        TrainerConfig(lr=5e-2, lora=LORA),
        pad_id=tokenizer.pad_id,
        tokenizer=tokenizer,
    )
    for v in range(2):  # B leaves zero: the adapter changes the policy
        trainer.train_step(_batch(model, tokenizer, version=v))
    return trainer, tokenizer


def _engine(seed: int) -> EmbeddedEngine:
    """An engine over the same architecture with other weights and another adapter init."""
    model, tokenizer = build_arithmetic_model("micro", seed=seed)
    lora_lib.add_adapters(model, LORA, seed=seed)
    config = EmbeddedEngineConfig(
        kv_budget_tokens=512,
        max_running=4,
        max_seq_len=64,
        temperature=T,
        eos_token_id=tokenizer.eos_id,
        seed=3,
    )
    return EmbeddedEngine(model, config)


def _generate(engine: EmbeddedEngine, tokenizer) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    prompts = [tokenizer.encode(p, add_bos=True) for p in ("12+3=", "7*8=", "40-9=")]
    engine.submit(
        [
            GenerationRequest(i, p.astype(np.int32), empty_i, empty_f, empty_i, 12)
            for i, p in enumerate(prompts)
        ]
    )
    done = {}
    while engine.has_work:
        done.update((o.traj_id, o) for o in engine.step())
    return [(p, done[i].tokens, done[i].logprobs) for i, p in enumerate(prompts)]


def _scored(logits_of, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log softmax(logits / T) of ``tokens`` after ``prompt``, by a full forward."""
    ids = torch.from_numpy(np.concatenate([prompt, tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = logits_of(ids)[0, len(prompt) - 1 : -1].float() / T
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
    return lp.numpy()


def test_after_a_lora_step_the_engine_samples_with_the_trainers_logprobs():
    trainer, tokenizer = _trained()
    engine = _engine(seed=5)
    assert set(engine.weight_shapes()) == set(trainer.export_weights())
    engine.load_base_weights(trainer.export_base_weights())
    engine.load_weights(trainer.export_weights(), version=2)
    assert engine.state().version == 2

    merged, _ = build_arithmetic_model("micro", seed=9)
    load_policy_state(merged, lora_lib.merged_state(trainer.model))
    merged.eval()
    base_only, _ = build_arithmetic_model("micro", seed=9)
    load_policy_state(base_only, trainer.export_base_weights())
    base_only.eval()

    gap = 0.0
    for prompt, tokens, logprobs in _generate(engine, tokenizer):
        assert len(tokens) > 1
        ours = _scored(trainer._backend.logits, prompt, tokens)
        np.testing.assert_allclose(logprobs, ours, atol=2e-5)
        np.testing.assert_allclose(
            logprobs, _scored(lambda x: merged(x).logits, prompt, tokens), atol=2e-5
        )
        gap = max(
            gap, float(np.abs(ours - _scored(lambda x: base_only(x).logits, prompt, tokens)).max())
        )
    assert gap > 1e-2  # the adapter matters: the base alone scores the tokens otherwise


def test_a_version_carries_the_adapter_only_and_is_checked_before_copying():
    trainer, _ = _trained()
    engine = _engine(seed=5)
    shapes = engine.weight_shapes()
    assert all(".lora_" in n for n in shapes)
    assert set(engine.base_weight_shapes()) == set(trainer.export_base_weights())
    adapter = trainer.export_weights()
    before = {k: v.detach().clone() for k, v in lora_lib.adapter_state(engine._model).items()}
    bad = dict(adapter)
    name = next(iter(bad))
    bad[name] = bad[name][:, :1]
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(bad, version=1)
    full = {**adapter, **trainer.export_base_weights()}
    with pytest.raises(ValueError, match=r"unexpected|unknown"):
        engine.load_weights(full, version=1)  # a full-weight version does not fit
    after = lora_lib.adapter_state(engine._model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.state().version == 0


def test_an_engine_without_adapters_refuses_a_base_load():
    model, _ = build_arithmetic_model("micro", seed=0)
    engine = EmbeddedEngine(
        model, EmbeddedEngineConfig(kv_budget_tokens=64, max_running=1, max_seq_len=32)
    )
    assert not engine.adapters and engine.base_weight_shapes() == {}
    with pytest.raises(ValueError, match="no LoRA adapters"):
        engine.load_base_weights({})
