"""The embedded trainer's checkpoint (what a run writes as ``<run>/checkpoint``, the
final policy) is a Hugging Face folder: ``AutoModelForCausalLM.from_pretrained`` loads it
and generates, greedily, the tokens the trainer's own model generates. (The Megatron
trainer's export: tests/staleflow/trainers/test_megatron_equivalence.py; both loaded by
vLLM: tests/staleflow/engines/test_vllm_export.py, in CI's vLLM stage.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.staleflow.trainers.test_trainers_embedded import PROMPT, _batch, _setup  # noqa: E402


def _generate(model, ids, tokenizer) -> list[int]:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=10,
        min_new_tokens=10,  # no early stop: ten tokens to compare
        pad_token_id=tokenizer.pad_id,
    )
    return out[0, ids.shape[1] :].tolist()


def test_the_embedded_checkpoint_loads_in_transformers_and_generates_the_trainers_tokens(
    tmp_path,
):
    from transformers import AutoModelForCausalLM

    model, tokenizer, trainer = _setup()
    initial = model.model.norm.weight.detach().clone()
    trainer.train_step(_batch(model, tokenizer))  # the weights leave their initial values
    assert not torch.equal(model.model.norm.weight, initial)
    trainer.save_checkpoint(tmp_path / "checkpoint")

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", local_files_only=True)
    loaded.eval()
    model.eval()
    ids = torch.tensor([tokenizer.encode(PROMPT, add_bos=True).tolist()])
    with torch.no_grad():
        ours = _generate(model, ids, tokenizer)
        theirs = _generate(loaded, ids, tokenizer)
        assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-6)
    assert len(theirs) == 10 and theirs == ours
