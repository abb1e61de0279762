"""The frozen reference policy and the KL term in the embedded trainer: the initial policy
by default, a model folder by ``trainer.ref.path``; ``train/ref_kl`` and the loss term
against the KL computed apart from the trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.config.loss import RefConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models.checkpoint import save_pretrained  # noqa: E402
from staleflow.models.errors import ModelError  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from staleflow.trainers.sequences import build_sequences  # noqa: E402
from tests.staleflow.trainers.masked import masked_batch  # noqa: E402
from trajectory_server.types import TrainingBatch  # noqa: E402

BASE = {"lr": 1e-2, "max_grad_norm": 1e9}  # the gradient as computed, unclipped


def _trainer(reference=None, **config):
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    trainer = EmbeddedTrainer(
        model,
        TrainerConfig(**{**BASE, **config}),
        pad_id=tokenizer.pad_id,
        tokenizer=tokenizer,
        reference=reference,
    )
    trainer.grads = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        named = dict(model.named_parameters())
        trainer.grads.append({k: p.grad.clone() for k, p in named.items() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return model, tokenizer, trainer


def _other_policy():
    ref, _ = build_arithmetic_model("micro", seed=1)
    return ref.requires_grad_(False).eval()


def _same_weights(a, b) -> bool:
    sa, sb = policy_state(a), policy_state(b)
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def _trained_logprobs(model, batch):
    """Per sequence, the logprobs of its trained tokens under ``model`` (with gradient)."""
    sequences, _ = build_sequences(batch, "grpo", version=0)
    out = []
    for s in sequences:
        ids = torch.from_numpy(s.ids)[None]
        logits = model(input_ids=ids).logits[0, s.prompt_len - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, s.prompt_len :, None]).squeeze(-1)
        out.append(lp[torch.from_numpy(s.mask)])
    return out


def test_the_default_reference_is_the_initial_policy_and_stays_frozen():
    model, tokenizer, trainer = _trainer(kl_coef=0.1)
    initial, _ = build_arithmetic_model("micro", seed=0)
    batch = masked_batch(model, tokenizer)
    first = trainer.train_step(batch)
    # the policy is its own reference before its first update: no KL, exactly
    assert first["train/ref_kl"] == 0.0 and first["train/kl_loss"] == 0.0
    second = trainer.train_step(batch)
    assert not _same_weights(model, initial)  # the policy moved ...
    assert _same_weights(trainer.reference, initial)  # ... its reference did not
    assert second["train/ref_kl"] > 0 and second["train/kl_loss"] > 0
    assert all(not p.requires_grad for p in trainer.reference.parameters())


def test_no_reference_without_a_kl_term_unless_tracked():
    model, tokenizer, trainer = _trainer()
    assert trainer.reference is None
    batch = masked_batch(model, tokenizer)
    assert "train/ref_kl" not in trainer.train_step(batch)
    _, _, tracked = _trainer(reference=_other_policy(), ref=RefConfig(track=True))
    _, _, plain = _trainer()
    with_metric, without = tracked.train_step(batch), plain.train_step(batch)
    assert with_metric["train/ref_kl"] > 0 and with_metric["train/kl_loss"] == 0.0
    # tracked only: the loss and its gradient are the ones without a reference
    assert with_metric["train/loss"] == without["train/loss"]
    assert all(torch.equal(tracked.grads[0][k], plain.grads[0][k]) for k in plain.grads[0])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_term_and_metric_against_the_kl_computed_apart(estimator):
    """KL on minus KL off: the loss differs by ``kl_coef x mean_t k(t)`` and the gradient
    by that term's gradient, both computed here from the two models' logprobs."""
    coef = 0.5
    model, tokenizer, on = _trainer(reference=_other_policy(), kl_coef=coef,
                                    kl_estimator=estimator)  # fmt: skip
    batch = masked_batch(model, tokenizer)
    _, _, off = _trainer()
    m_on, m_off = on.train_step(batch), off.train_step(batch)

    policy, _ = build_arithmetic_model("micro", seed=0)
    reference = _other_policy()
    lp = torch.cat(_trained_logprobs(policy, batch))
    with torch.no_grad():
        ref = torch.cat(_trained_logprobs(reference, batch))
    log_q = ref - lp  # log(π_ref / π_θ)
    k = {"k1": -log_q, "k2": 0.5 * log_q**2, "k3": torch.expm1(log_q) - log_q}[estimator]
    term = coef * k.sum() / len(k)  # token_mean over the batch's trained tokens
    term.backward()
    k3 = (torch.expm1(log_q) - log_q).detach()
    assert m_on["train/ref_kl"] == pytest.approx(float(k3.mean()), rel=1e-5)
    assert m_on["train/kl_loss"] == pytest.approx(term.item(), rel=1e-5, abs=1e-7)
    assert m_on["train/loss"] - m_off["train/loss"] == pytest.approx(term.item(), rel=1e-4)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(on.grads[0][name] - off.grads[0][name], p.grad,
                                   rtol=1e-4, atol=1e-6)  # fmt: skip


def test_ref_path_loads_a_model_folder_and_refuses_another_architecture(tmp_path):
    other, tokenizer = build_arithmetic_model("micro", seed=1)
    folder = save_pretrained(other, tokenizer, tmp_path / "ref")
    model, _ = build_arithmetic_model("micro", seed=0)
    section = TrainerConfig(kl_coef=0.1, ref=RefConfig(path=str(folder)))
    trainer = EmbeddedTrainer.from_section(model, section, pad_id=tokenizer.pad_id)
    assert _same_weights(trainer.reference, other)
    assert not _same_weights(trainer.reference, model)
    bigger, _ = build_arithmetic_model("tiny", seed=0)
    wrong = save_pretrained(bigger, tokenizer, tmp_path / "tiny")
    section = TrainerConfig(kl_coef=0.1, ref=RefConfig(path=str(wrong)))
    with pytest.raises(ModelError, match="do not match"):
        EmbeddedTrainer.from_section(model, section, pad_id=tokenizer.pad_id)


def test_a_checkpoint_keeps_the_initial_reference_for_a_resumed_run(tmp_path):
    model, tokenizer, trainer = _trainer(kl_coef=0.1)
    initial, _ = build_arithmetic_model("micro", seed=0)
    trainer.train_step(masked_batch(model, tokenizer))
    trainer.save_checkpoint(tmp_path / "ck")
    # a resumed run builds its trainer from the checkpoint's weights, then loads it
    resumed = EmbeddedTrainer(model, TrainerConfig(**BASE, kl_coef=0.1), pad_id=tokenizer.pad_id)
    assert not _same_weights(resumed.reference, initial)
    resumed.load_checkpoint(tmp_path / "ck")
    assert _same_weights(resumed.reference, initial)
    assert not (tmp_path / "ck" / "reference.safetensors").exists()  # vLLM would load it


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_a_streamed_step_with_the_kl_term_equals_the_whole_step(loss_agg):
    config = {"kl_coef": 0.5, "loss_agg": loss_agg, "loss": "gspo"}
    model, tokenizer, whole = _trainer(reference=_other_policy(), **config)
    batch = masked_batch(model, tokenizer)
    expected = whole.train_step(batch)
    _, _, streamed = _trainer(reference=_other_policy(), **config)
    streamed.stream(TrainingBatch(batch.groups[:1], (), batch.temperature))
    got = streamed.train_step(TrainingBatch(batch.groups[1:], (), batch.temperature))
    for key in ("train/loss", "train/kl_loss", "train/ref_kl"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    for k, g in whole.grads[0].items():
        torch.testing.assert_close(streamed.grads[0][k], g, rtol=1e-5, atol=1e-7)
    assert math.isfinite(got["train/grad_norm"])
    assert np.isclose(got["train/tokens"], expected["train/tokens"])
