"""The loss pieces against hand computations on small tensors."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from staleflow.trainers.losses import (  # noqa: E402
    approx_kl,
    behaviour_weights,
    group_advantages,
    policy_loss,
    ppo_clip_loss,
    token_level_loss,
)


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_group_advantages_grpo_and_no_std():
    rewards = _t(1, 0, 0, 0, 1, 1, 0.5, 2, 0)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 3])
    adv = group_advantages(rewards, groups)
    # group 0: mean 1/4, sample std sqrt((9/16 + 3/16) / 3) = 1/2
    # group 1 (all equal) and 2 (alone): zero; group 3: mean 1, std sqrt(2)
    expected = [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 1 / math.sqrt(2), -1 / math.sqrt(2)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    plain = group_advantages(rewards, groups, normalize_std=False)
    assert plain.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 1, -1])
    assert adv.dtype == rewards.dtype


def test_flat_groups_get_exactly_zero():
    rewards = _t(0.1, 0.1, 0.1, 0.7, 0.7)
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]))
    assert torch.equal(adv, torch.zeros(5))
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(rewards, torch.tensor([0, 0]))


def test_token_level_loss_sums_over_tokens():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(token_level_loss(values, mask)) == pytest.approx(7 / 3)
    # a micro-batch divides by the whole batch's token count
    assert float(token_level_loss(values, mask, total_tokens=7)) == pytest.approx(1.0)


def test_ppo_clip_with_clip_higher():
    ratio = _t(1.5, 0.5, 1.1, 0.7, 1.25)
    adv = _t(1, -1, 1, 1, 1)
    old = torch.zeros(5)
    loss, clipped = ppo_clip_loss(ratio.log(), old, adv, eps_low=0.2, eps_high=0.28)
    # 1.5 > 1.28 with A > 0: clipped to 1.28; 0.5 < 0.8 with A < 0: clipped to 0.8;
    # 1.1 inside; 0.7 below the range but A > 0 keeps the smaller unclipped term;
    # 1.25 is inside [0.8, 1.28] (clip-higher), where the symmetric 0.2 would clip it
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -1.1, -0.7, -1.25], abs=1e-6)
    assert clipped.tolist() == [True, True, False, False, False]


def test_behaviour_weights_truncate_or_mask():
    prox = _t(0.5, 0.5, 0.5).log()
    behav = _t(0.5, 0.1, 0.4).log()
    w, capped = behaviour_weights(prox, behav)
    assert w.tolist() == pytest.approx([1.0, 5.0, 1.25], rel=1e-5)
    assert not capped.any()
    w, capped = behaviour_weights(prox, behav, cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 1.25], rel=1e-5)
    assert capped.tolist() == [False, True, False]
    w, _ = behaviour_weights(prox, behav, cap=2.0, cap_mode="mask")
    assert w.tolist() == pytest.approx([1.0, 0.0, 1.25], rel=1e-5)
    with pytest.raises(ValueError, match="cap_mode"):
        behaviour_weights(prox, behav, cap=2.0, cap_mode="clip")  # type: ignore[arg-type]


def test_approx_kl_k3():
    kl = approx_kl(_t(0.5, 0.25).log(), _t(0.25, 0.25).log())
    assert kl.tolist() == pytest.approx([1 - math.log(2), 0.0], abs=1e-6)
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=generator), torch.randn(100, generator=generator)
    assert (approx_kl(a, b) >= 0).all()


@pytest.mark.parametrize("mode", ["decoupled", "tis"])
def test_decoupled_and_tis_weight_the_policy_gradient(mode):
    logprobs = _t(0.5, 0.2, 0.9).log().requires_grad_(True)
    behav = _t(0.25, 0.4, 0.9).log()
    adv = _t(1.0, -2.0, 0.5)
    mask = _t(1, 1, 0)
    out = policy_loss(
        logprobs,
        behav,
        adv,
        mask,
        off_policy=mode,
        prox_logprobs=logprobs.detach(),
        is_cap=1.5,
        is_cap_mode="truncate",
    )
    out.loss.backward()
    # prox == current: ratio 1, no clipping; weights min(prox / behav, 1.5) = [1.5, 0.5]
    assert out.weights.tolist()[:2] == pytest.approx([1.5, 0.5], rel=1e-5)
    assert out.capped.tolist()[:2] == [True, False]
    assert out.loss.item() == pytest.approx(-(1.5 * 1.0 + 0.5 * -2.0) / 2, rel=1e-5)
    # d loss / d logprob = -w * A / tokens; masked token: none
    assert logprobs.grad.tolist() == pytest.approx([-1.5 / 2, 1.0 / 2, 0.0], rel=1e-5)
    assert not out.clipped.any()


def test_none_uses_behaviour_logprobs_as_old_policy():
    logprobs = _t(0.5, 0.2).log().requires_grad_(True)
    behav = _t(0.25, 0.4).log()  # ratios 2 and 0.5
    adv = _t(1.0, -1.0)
    out = policy_loss(logprobs, behav, adv, _t(1, 1), off_policy="none")
    out.loss.backward()
    # both clipped (2 > 1.28 with A > 0, 0.5 < 0.8 with A < 0): no gradient
    assert out.loss.item() == pytest.approx((-1.28 + 0.8) / 2, rel=1e-5)
    assert out.clipped.tolist() == [True, True]
    assert logprobs.grad.tolist() == [0.0, 0.0]
    assert out.ratio.tolist() == pytest.approx([2.0, 0.5], rel=1e-5)
    assert out.weights.tolist() == [1.0, 1.0]


def test_policy_loss_argument_errors():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="needs prox_logprobs"):
        policy_loss(x, x, x, x + 1, off_policy="decoupled")
    with pytest.raises(ValueError, match="off_policy"):
        policy_loss(x, x, x, x + 1, off_policy="ppo")  # type: ignore[arg-type]


def test_decoupled_masks_and_tis_truncates_weights_above_the_cap_by_default():
    logprobs = _t(0.5, 0.2).log().requires_grad_(True)
    behav = _t(0.25, 0.4).log()  # weights prox / behav = 2 and 0.5
    adv, mask = _t(1.0, -2.0), _t(1, 1)
    common = dict(prox_logprobs=logprobs.detach(), is_cap=1.5)
    decoupled = policy_loss(logprobs, behav, adv, mask, off_policy="decoupled", **common)
    tis = policy_loss(logprobs, behav, adv, mask, off_policy="tis", **common)
    assert decoupled.weights.tolist() == pytest.approx([0.0, 0.5], rel=1e-5)  # AReaL: dropped
    assert tis.weights.tolist() == pytest.approx([1.5, 0.5], rel=1e-5)  # Yao et al.: truncated
    assert decoupled.loss.item() != pytest.approx(tis.loss.item())
    # an explicit mode overrides the default of either
    forced = policy_loss(
        logprobs, behav, adv, mask, off_policy="decoupled", is_cap_mode="truncate", **common
    )
    assert forced.weights.tolist() == pytest.approx([1.5, 0.5], rel=1e-5)
    with pytest.raises(ValueError, match="is_cap_mode"):
        policy_loss(logprobs, behav, adv, mask, off_policy="tis", is_cap_mode="clip", **common)
