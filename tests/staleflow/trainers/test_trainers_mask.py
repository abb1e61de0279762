"""The loss mask in the embedded trainer (issue 34): observation tokens of a multi-turn
trajectory are context, never trained; an all-True mask is the single-turn loss."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.trainers import rl  # noqa: E402
from staleflow.trainers.batch_checks import BatchError, validate_batch  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from staleflow.trainers.losses import policy_loss  # noqa: E402
from staleflow.trainers.sequences import build_sequences, pad  # noqa: E402
from tests.staleflow.trainers.masked import (  # noqa: E402
    map_trajectories,
    masked_batch,
    perturb_observations,
    unmasked,
)
from trajectory_server.types import TrainingBatch  # noqa: E402

# an IS cap that bites on the stale members, so that capping and clipping are both active
SETTINGS = {"lr": 1e-2, "is_cap": 1.2, "eps_low": 0.05, "eps_high": 0.05}
NOT_COMPARED = ("train/step_time_s",)


def _trainer(reference=None, **config):
    """A trainer whose ``grads`` lists the gradients of each update (Adam's first step is
    close to ``lr * sign(g)``: weights alone would hide a mis-scaled gradient)."""
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    trainer = EmbeddedTrainer(
        model,
        TrainerConfig(**{**SETTINGS, **config}),
        pad_id=tokenizer.pad_id,
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


def _weights(model):
    return {k: v.detach().clone() for k, v in policy_state(model).items()}


def _step(batch, reference=None, **config):
    model, _, trainer = _trainer(reference, **config)
    metrics = trainer.train_step(batch)
    return metrics, trainer.grads, _weights(model)


def _same(a, b) -> None:
    (ma, ga, wa), (mb, gb, wb) = a, b
    for key in ma.keys() - set(NOT_COMPARED):
        assert ma[key] == mb[key] or (math.isnan(ma[key]) and math.isnan(mb[key])), key
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize(
    ("off_policy", "updates"), [("decoupled", 1), ("decoupled", 2), ("tis", 2), ("none", 1)]
)
def test_observation_tokens_change_nothing_in_a_step(off_policy, updates):
    """Other logprobs and versions on the observations: the same loss, gradients of every
    update, metrics (importance weights, clip and correction fractions, staleness) and
    weights, bit for bit. Training the observations too changes all of that."""
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = masked_batch(model, tokenizer)
    config = {"off_policy": off_policy, "updates_per_step": updates}
    base = _step(batch, **config)
    _same(base, _step(perturb_observations(batch), **config))
    metrics = base[0]
    trained = sum(int(t.mask.sum()) for g in batch.groups for t in g.trajectories)
    assert metrics["train/tokens"] == trained
    if off_policy != "none":  # the stale members are corrected: the metric is not vacuous
        assert 0 < metrics["train/corrected_frac"] < 1
    # the control: the same tokens, all trained, give another step
    all_in = _step(unmasked(batch), **config)
    assert all_in[0]["train/tokens"] > trained
    assert any(not torch.equal(all_in[1][0][k], base[1][0][k]) for k in base[1][0])


def _reference():
    """A reference policy other than the initial one: its KL and gradient are not 0."""
    return build_arithmetic_model("micro", seed=1)[0].requires_grad_(False).eval()


@pytest.mark.parametrize(
    "config",
    [
        {"loss": "gspo"},  # loss_agg=auto: seq_mean_token_mean
        {"loss": "gspo", "loss_agg": "token_mean", "kl_coef": 0.1, "kl_estimator": "k2"},
        {"loss": "cispo", "loss_agg": "seq_mean_token_sum"},
        {"loss": "cispo", "kl_coef": 0.1, "updates_per_step": 2},
        {"advantage": "drgrpo", "loss_norm_len": 16, "kl_coef": 0.1},
        {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1, "kl_estimator": "k1"},
    ],
    ids=lambda c: "-".join(f"{v}" for v in c.values()),
)
def test_observation_tokens_change_nothing_with_any_loss_aggregation_or_kl(config):
    """Every loss variant, aggregation and KL estimator: the observations' logprobs and
    versions change nothing (loss, KL, gradients, metrics, weights); the control, the
    same tokens all trained, changes the step."""
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = masked_batch(model, tokenizer)
    base = _step(batch, _reference(), **config)
    _same(base, _step(perturb_observations(batch), _reference(), **config))
    trained = sum(int(t.mask.sum()) for g in batch.groups for t in g.trajectories)
    assert base[0]["train/tokens"] == trained
    if config.get("kl_coef"):
        assert base[0]["train/kl_loss"] != 0.0
    all_in = _step(unmasked(batch), _reference(), **config)
    assert all_in[0]["train/tokens"] > trained
    assert any(not torch.equal(all_in[1][0][k], base[1][0][k]) for k in base[1][0])


def test_a_micro_batch_reads_advantages_and_logprobs_only_where_it_trains():
    """Per-token advantages, behaviour and proximal logprobs changed everywhere the loss
    mask is False (observations, prompt, padding): the same loss and gradients."""
    model, tokenizer, trainer = _trainer()
    batch = masked_batch(model, tokenizer)
    sequences, _ = build_sequences(batch, "grpo", version=2)
    sequences = [dataclasses.replace(s, prox=s.behav + 0.1) for s in sequences]
    mb = pad(sequences, tokenizer.pad_id)
    off = ~mb.mask
    assert off[:, : min(s.prompt_len for s in sequences) - 1].all()  # the prompt
    assert off.sum() > off[:, : min(s.prompt_len for s in sequences) - 1].sum()
    gen = torch.Generator().manual_seed(0)
    noisy = dataclasses.replace(
        mb,
        adv=torch.where(off, torch.randn(mb.adv.shape, generator=gen) * 9, mb.adv),
        behav=torch.where(off, -torch.rand(mb.behav.shape, generator=gen) * 9, mb.behav),
        prox=torch.where(off, -torch.rand(mb.behav.shape, generator=gen) * 9, mb.prox),
    )
    settings = trainer.config
    out = []
    for m in (mb, noisy):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=m.ids).logits
        loss = rl.micro_loss(
            trainer._backend, m, logits, settings, temperature=1.0, total_tokens=7.0,
            tally=rl.LossTally(),
        )  # fmt: skip
        loss.backward()
        out.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


def test_an_all_true_mask_is_the_loss_over_every_response_token():
    """The regression: with every token trained, the step's loss and gradient are the
    single-turn ones, computed here apart from the trainer (each sequence alone through
    the model, ``policy_loss`` over all its response tokens, over the batch's count)."""
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = unmasked(masked_batch(model, tokenizer))
    metrics, grads, _ = _step(batch, max_grad_norm=1e9)  # the gradient as computed, unclipped
    model, _ = build_arithmetic_model("micro", seed=0)
    sequences, _ = build_sequences(batch, "grpo", version=0)
    total = sum(s.response_len for s in sequences)
    assert metrics["train/tokens"] == total
    settings = TrainerConfig(**SETTINGS)
    reference = torch.zeros(())
    for s in sequences:
        ids = torch.from_numpy(s.ids)[None]
        logits = model(input_ids=ids).logits[0, s.prompt_len - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, s.prompt_len :, None])
        lp = lp.squeeze(-1)
        reference = (
            reference
            + policy_loss(
                lp,
                torch.from_numpy(s.behav),
                torch.full_like(lp, s.advantage),
                torch.ones_like(lp),
                prox_logprobs=lp.detach(),
                eps_low=settings.eps_low,
                eps_high=settings.eps_high,
                is_cap=settings.is_cap,
                denominator=total,
            ).loss
        )
    reference.backward()
    assert metrics["train/loss"] == pytest.approx(reference.item(), rel=1e-6, abs=1e-9)
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[0][k], p.grad, rtol=1e-5, atol=1e-7)


def test_a_trajectory_with_no_trained_token_counts_in_its_group_and_trains_nothing():
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = masked_batch(model, tokenizer)
    silent = batch.groups[0].trajectories[1].traj_id

    def silence(t):
        if t.traj_id != silent:
            return t
        return dataclasses.replace(t, mask=np.zeros(len(t.tokens), np.bool_))

    quiet = map_trajectories(batch, silence)
    base, with_silent = _step(batch)[0], _step(quiet)[0]
    assert with_silent["train/trajectories"] == base["train/trajectories"] == 6
    # its reward still shapes its siblings' advantages: the batch's are unchanged
    assert with_silent["train/advantage_abs_mean"] == base["train/advantage_abs_mean"]
    gone = int(batch.groups[0].trajectories[1].mask.sum())
    assert with_silent["train/tokens"] == base["train/tokens"] - gone
    assert with_silent["train/updates"] == 1


def test_a_batch_with_no_trained_token_takes_no_update():
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = map_trajectories(
        masked_batch(model, tokenizer),
        lambda t: dataclasses.replace(t, mask=np.zeros(len(t.tokens), np.bool_)),
    )
    model, _, trainer = _trainer()
    before = _weights(model)
    metrics = trainer.train_step(batch)
    assert metrics["train/updates"] == 0 and math.isnan(metrics["train/grad_norm"])
    assert metrics["train/tokens"] == 0 and metrics["train/trajectories"] == 6
    assert trainer.grads == [] and trainer.version == 1
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_streamed_step_of_a_masked_batch_equals_the_whole_step():
    """trainer.stream: each part's token sum is of its trained tokens, divided once by
    the whole batch's trained count."""
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = masked_batch(model, tokenizer)
    whole = _step(batch)
    model, _, trainer = _trainer()
    trainer.stream(TrainingBatch(batch.groups[:1], (), batch.temperature))
    metrics = trainer.train_step(TrainingBatch(batch.groups[1:], (), batch.temperature))
    assert metrics["train/tokens"] == whole[0]["train/tokens"]
    assert metrics["train/loss"] == pytest.approx(whole[0]["train/loss"], rel=1e-5)
    for k, g in whole[1][0].items():
        torch.testing.assert_close(trainer.grads[0][k], g, rtol=1e-5, atol=1e-8)


def test_the_batch_check_reads_the_mask():
    model, tokenizer = build_arithmetic_model("micro", seed=0)
    batch = masked_batch(model, tokenizer)
    vocab = tokenizer.vocab_size

    def obs_logprob(value):
        def change(t):
            lp = t.logprobs.copy()
            lp[~t.mask] = value
            return dataclasses.replace(t, logprobs=lp)

        return change

    # an observation carries no logprob of the policy: whatever it holds is not checked
    validate_batch(map_trajectories(batch, obs_logprob(np.nan)), vocab)
    validate_batch(map_trajectories(batch, obs_logprob(3.0)), vocab)
    short = map_trajectories(batch, lambda t: dataclasses.replace(t, mask=t.mask[:-1]))
    with pytest.raises(BatchError, match="loss mask"):
        validate_batch(short, vocab)
    ints = map_trajectories(batch, lambda t: dataclasses.replace(t, mask=t.mask.astype(int)))
    with pytest.raises(BatchError, match="loss mask"):
        validate_batch(ints, vocab)
