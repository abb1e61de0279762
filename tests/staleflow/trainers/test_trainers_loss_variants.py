"""GSPO, CISPO, Dr. GRPO, the aggregation modes and the KL estimators against numbers
computed by hand (in the comments) on tensors of a few tokens."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from staleflow.trainers.losses import (  # noqa: E402
    aggregate,
    group_advantages,
    kl_penalty,
    loss_units,
    policy_loss,
)

LOG2 = math.log(2.0)
SQRT2 = math.sqrt(2.0)


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


def _rows(*values):
    return torch.tensor(values, dtype=torch.long)


# -- aggregation ---------------------------------------------------------------------------

# token losses of two sequences: [1, 2 | 3, 4, 5]
LOSSES = _t(1, 2, 3, 4, 5)
ROWS = _rows(0, 0, 1, 1, 1)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 15 / 5),  # (1+2+3+4+5) / 5 tokens
        ("seq_mean_token_mean", (1.5 + 4.0) / 2),  # (3/2 + 12/3) / 2 sequences
        ("seq_mean_token_sum", (3 + 12) / 2),
        ("seq_mean_token_sum_norm", (3 + 12) / 10 / 2),  # L = 10
    ],
)
def test_each_aggregation_by_hand(mode, expected):
    keep = torch.ones(5, dtype=torch.bool)
    got = aggregate(LOSSES, keep, ROWS, mode, norm_len=10)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 3 + 5) / 4),
        ("seq_mean_token_mean", (1.5 + 4.0) / 2),  # the second sequence's mean is (3+5)/2
        ("seq_mean_token_sum", (3 + 8) / 2),
        ("seq_mean_token_sum_norm", (3 + 8) / 10 / 2),
    ],
)
def test_a_masked_token_counts_in_no_aggregation(mode, expected):
    """The fourth token is an observation: whatever its loss (here 1000, or NaN), it is
    in no sum and no count."""
    keep = torch.tensor([True, True, True, False, True])
    for junk in (1000.0, math.nan):
        losses = LOSSES.clone()
        losses[3] = junk
        assert aggregate(losses, keep, ROWS, mode, norm_len=10).item() == pytest.approx(expected)


def test_a_denominator_of_the_whole_batch_replaces_the_local_count():
    keep = torch.ones(5, dtype=torch.bool)
    # micro-batches of one global batch of 4 sequences: this one's sum over 4
    got = aggregate(LOSSES, keep, ROWS, "seq_mean_token_sum", denominator=4)
    assert got.item() == pytest.approx(15 / 4)
    assert loss_units("token_mean", [2, 3, 0]) == 5.0
    assert loss_units("seq_mean_token_mean", [2, 3, 0]) == 2.0  # no trained token: none
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(LOSSES, keep, ROWS, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(LOSSES, keep, ROWS, "mean")


# -- GSPO ----------------------------------------------------------------------------------


def _gspo_case():
    # sequence 0: π_θ / π_old = 2 then 1, sequence 1: 1. s_0 = exp((log 2 + 0) / 2) = √2
    logprobs = _t(0.5, 0.4, 0.3).log().requires_grad_(True)
    old = _t(0.25, 0.4, 0.3).log()
    adv = _t(1.0, 1.0, -1.0)
    return logprobs, old, adv


def test_gspo_clips_the_whole_sequence_on_its_length_normalised_ratio():
    logprobs, old, adv = _gspo_case()
    out = policy_loss(
        logprobs, old, adv, _t(1, 1, 1), loss="gspo", off_policy="none",
        aggregation="seq_mean_token_mean", rows=_rows(0, 0, 1),
    )  # fmt: skip
    out.loss.backward()
    # s_0 = √2 > 1.28 with A > 0: clipped to 1.28 on both tokens; s_1 = 1: loss +1
    assert out.ratio.tolist() == pytest.approx([SQRT2, SQRT2, 1.0], rel=1e-6)
    assert out.clipped.tolist() == [True, True, False]
    assert out.loss.item() == pytest.approx((-1.28 + 1.0) / 2, rel=1e-6)
    # clipped: no gradient; sequence 1: d(-s A)/d logπ = 1, weighted 1/2 seqs x 1/1 token
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.5], abs=1e-7)


@pytest.mark.parametrize(
    ("mode", "value", "grads"),
    [
        # (1/2)(-√2·2/2 + 1/1); d/dlogπ_0 = -(1/2)(1/2)√2 (the sequence mean's share)
        ("seq_mean_token_mean", (-SQRT2 + 1) / 2, [-SQRT2 / 4, -SQRT2 / 4, 0.5]),
        # (-√2 - √2 + 1) / 3 tokens; each token's gradient is its own s A / 3
        ("token_mean", (-2 * SQRT2 + 1) / 3, [-SQRT2 / 3, -SQRT2 / 3, 1 / 3]),
    ],
)
def test_gspo_unclipped_value_and_gradient(mode, value, grads):
    logprobs, old, adv = _gspo_case()
    out = policy_loss(
        logprobs, old, adv, _t(1, 1, 1), loss="gspo", off_policy="none",
        eps_low=0.9, eps_high=9.0, aggregation=mode, rows=_rows(0, 0, 1),
    )  # fmt: skip
    out.loss.backward()
    assert not out.clipped.any()
    assert out.loss.item() == pytest.approx(value, rel=1e-6)
    assert logprobs.grad.tolist() == pytest.approx(grads, rel=1e-6)


def test_a_masked_token_is_not_in_the_gspo_sequence_ratio():
    """An observation with a wild log-ratio (π_θ / π_old = 1000) inside sequence 0
    changes neither its ratio nor the loss."""
    logprobs = _t(0.5, 0.9, 0.4, 0.3).log()
    old = _t(0.25, 0.0009, 0.4, 0.3).log()
    keep = _t(1, 0, 1, 1)
    out = policy_loss(
        logprobs, old, _t(1.0, 1.0, 1.0, -1.0), keep, loss="gspo", off_policy="none",
        eps_low=0.9, eps_high=9.0, aggregation="seq_mean_token_mean", rows=_rows(0, 0, 0, 1),
    )  # fmt: skip
    assert out.ratio[[0, 2, 3]].tolist() == pytest.approx([SQRT2, SQRT2, 1.0], rel=1e-6)
    assert out.loss.item() == pytest.approx((-SQRT2 + 1) / 2, rel=1e-6)


# -- CISPO ---------------------------------------------------------------------------------


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    logprobs = _t(0.5, 0.2).log().requires_grad_(True)
    behav = _t(0.25, 0.4).log()  # r = 2 and 0.5
    adv = _t(1.0, -1.0)
    out = policy_loss(logprobs, behav, adv, _t(1, 1), loss="cispo", off_policy="none")
    out.loss.backward()
    # weights clip(2) = 1.28, clip(0.5) = 0.8; loss_t = -w A logπ:
    # -1.28·1·log 0.5 = 0.887228, -0.8·(-1)·log 0.2 = -1.287550; token mean
    assert out.token_losses.tolist() == pytest.approx([1.28 * LOG2, 0.8 * math.log(0.2)], rel=1e-6)
    assert out.loss.item() == pytest.approx((1.28 * LOG2 + 0.8 * math.log(0.2)) / 2, rel=1e-6)
    assert out.clipped.tolist() == [True, True]
    # where PPO's clip zeroes both gradients, CISPO keeps -w A / tokens
    assert logprobs.grad.tolist() == pytest.approx([-1.28 / 2, 0.8 / 2], rel=1e-6)
    ppo = policy_loss(logprobs.detach().requires_grad_(True), behav, adv, _t(1, 1),
                      off_policy="none")  # fmt: skip
    assert ppo.clipped.all()


# -- the off-policy correction composes with each variant ------------------------------------


def test_cispo_with_the_decoupled_correction_by_hand():
    """π_prox = π_θ (one update per step): r = 1 (weight 1, nothing clipped), and the
    behaviour weight w = π_prox / π_behav = 2 and 0.5 multiplies each token's term."""
    logprobs = _t(0.5, 0.2).log().requires_grad_(True)
    behav = _t(0.25, 0.4).log()
    out = policy_loss(
        logprobs, behav, _t(1.0, -1.0), _t(1, 1), loss="cispo", off_policy="decoupled",
        prox_logprobs=logprobs.detach(), is_cap=5.0,
    )  # fmt: skip
    out.loss.backward()
    # -2·1·log 0.5 = 1.386294, -0.5·(-1)·log 0.2 = -0.804719
    assert out.loss.item() == pytest.approx((2 * LOG2 + 0.5 * math.log(0.2)) / 2, rel=1e-6)
    assert logprobs.grad.tolist() == pytest.approx([-2 / 2, 0.5 / 2], rel=1e-6)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("off_policy", ["decoupled", "tis"])
def test_the_behaviour_weight_multiplies_each_variants_token_loss(loss, off_policy):
    """For every variant the correction is the same: the per-token loss against π_prox,
    times w = π_prox / π_behav (capped): the uncorrected loss with π_old = π_prox, weighted."""
    logprobs = _t(0.5, 0.4, 0.3).log()
    prox = _t(0.45, 0.5, 0.3).log()
    behav = _t(0.25, 0.4, 0.6).log()  # w = 1.8, 1.25, 0.5
    adv, keep, rows = _t(1.0, 1.0, -1.0), _t(1, 1, 1), _rows(0, 0, 1)
    common = dict(loss=loss, rows=rows, is_cap=5.0)
    corrected = policy_loss(
        logprobs, behav, adv, keep, off_policy=off_policy, prox_logprobs=prox, **common
    )
    plain = policy_loss(logprobs, prox, adv, keep, off_policy="none", **common)
    assert corrected.weights.tolist() == pytest.approx([1.8, 1.25, 0.5], rel=1e-5)
    assert corrected.token_losses.tolist() == pytest.approx(
        (corrected.weights * plain.token_losses).tolist(), rel=1e-6
    )


# -- Dr. GRPO ------------------------------------------------------------------------------


def test_drgrpo_advantages_and_constant_normalisation_by_hand():
    # rewards 1, 0, 0: mean 1/3; Dr. GRPO keeps r - mean (no std): 2/3, -1/3, -1/3
    adv = group_advantages(_t(1.0, 0.0, 0.0), _rows(0, 0, 0), normalize_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3], rel=1e-6)
    # GRPO divides by the sample std sqrt(((2/3)² + 2 (1/3)²) / 2) = sqrt(1/3)
    grpo = group_advantages(_t(1.0, 0.0, 0.0), _rows(0, 0, 0))
    root3 = math.sqrt(3)
    assert grpo.tolist() == pytest.approx([2 / 3 * root3, -1 / 3 * root3, -1 / 3 * root3], rel=1e-5)
    # the loss of a 1-token and a 3-token response, on-policy (r = 1): -A per token;
    # summed per sequence and divided by the constant L = 4, not by 1 and 3
    logprobs = _t(0.5, 0.5, 0.5, 0.5).log().requires_grad_(True)
    a = _t(2 / 3, -1 / 3, -1 / 3, -1 / 3)
    out = policy_loss(
        logprobs, logprobs.detach(), a, _t(1, 1, 1, 1), off_policy="none",
        aggregation="seq_mean_token_sum_norm", norm_len=4, rows=_rows(0, 1, 1, 1),
    )  # fmt: skip
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-2 / 3 + 3 * (1 / 3)) / 4 / 2, rel=1e-6)
    # every token's gradient is -A / (L · G), whatever its response's length
    assert logprobs.grad.tolist() == pytest.approx([-(2 / 3) / 8] + [(1 / 3) / 8] * 3, rel=1e-6)


# -- the KL to the reference -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        # π_θ = 0.5, π_ref = 0.25: log q = log(π_ref / π_θ) = -log 2
        ("k1", LOG2, 1.0),  # -log q; d/dlogπ_θ = 1
        ("k2", 0.5 * LOG2**2, LOG2),  # ½ (log q)²; d = -log q
        ("k3", 0.5 - 1 + LOG2, 0.5),  # (q - 1) - log q; d = 1 - q
    ],
)
def test_kl_estimators_by_hand(estimator, value, grad):
    logprobs = _t(0.5).log().requires_grad_(True)
    kl = kl_penalty(logprobs, _t(0.25).log(), estimator)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, rel=1e-6)
    assert logprobs.grad.item() == pytest.approx(grad, rel=1e-6)
    # the same policy: no KL; no gradient, except k1's, which is 1 whatever the two
    # policies (its pitfall as a loss: it lowers the sampled tokens' logprobs)
    same = _t(0.3).log().requires_grad_(True)
    k = kl_penalty(same, same.detach(), estimator)
    k.sum().backward()
    assert k.item() == 0.0
    assert same.grad.item() == (1.0 if estimator == "k1" else 0.0)


def test_kl_estimator_and_loss_names_are_checked():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="loss"):
        policy_loss(x, x, x, x + 1, loss="grpo", off_policy="none")
