"""Inverse-CDF sampling with top-p, and the counter-based uniforms behind it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from staleflow.engines.embedded.sampling import sample, uniforms  # noqa: E402


def test_uniforms_are_a_pure_function_of_seed_trajectory_and_index() -> None:
    u = uniforms(3, [5, 6, 5], [0, 0, 1])
    assert u.dtype == np.float64 and ((u >= 0) & (u < 1)).all()
    assert len(set(u.tolist())) == 3
    np.testing.assert_array_equal(uniforms(3, [5], [1]), u[2:])
    assert uniforms(4, [5], [0])[0] != u[0]
    many = uniforms(0, np.arange(20000), np.zeros(20000, np.int64))
    assert abs(many.mean() - 0.5) < 0.01


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.0, 0.7)])
def test_sampled_frequencies_follow_the_truncated_distribution(
    temperature: float, top_p: float
) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -30.0])
    n = 20000
    # A uniform grid of u values turns frequencies into an exact check of the CDF.
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens, logprobs = sample(logits.expand(n, -1), u, temperature=temperature, top_p=top_p)
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = order[(sorted_p.cumsum(0) - sorted_p) < top_p]
    want = torch.zeros_like(probs)
    want[keep] = probs[keep] / probs[keep].sum()
    got = torch.bincount(tokens, minlength=len(logits)).double() / n
    torch.testing.assert_close(got, want.double(), atol=2e-4, rtol=0)
    # Logprobs are of the tempered policy, not of the renormalised nucleus.
    ref = torch.log_softmax(logits / temperature, -1)[tokens]
    torch.testing.assert_close(logprobs, ref)


def test_greedy_takes_the_argmax_with_untempered_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 4.0, 4.5]])
    tokens, logprobs = sample(logits, torch.zeros(2), temperature=0.0, top_p=0.5)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_u_close_to_one_never_picks_a_token_outside_the_nucleus() -> None:
    logits = torch.tensor([[4.0, 3.0, -80.0, -90.0]])
    u = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    for top_p in (1.0, 0.5):
        tokens, _ = sample(logits, u, temperature=1.0, top_p=top_p)
        assert int(tokens[0]) in ((0, 1) if top_p == 1.0 else (0,))
