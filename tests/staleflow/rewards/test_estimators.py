"""mean@k and the unbiased pass@k estimator against values worked out by hand."""

from __future__ import annotations

import itertools

import pytest

from staleflow.rewards.estimators import pass_at_k, score_problems


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),  # nothing right: never
        (4, 4, 4, 1.0),  # all right: always
        (4, 1, 1, 0.25),  # pass@1 is the share right: c / n
        (4, 3, 1, 0.75),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (4, 1, 4, 1.0),  # k = n: any right answer among them
        (4, 2, 3, 1.0),  # n - c < k: every draw of 3 holds a right one
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_answer():
    """Unbiased: the mean over every size-k subset of the n responses, counted directly."""
    for n, c, k in [(6, 2, 3), (7, 3, 2), (5, 1, 5)]:
        responses = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(responses, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_score_problems_by_hand():
    rewards = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0, 0.0]}
    mean, passed = score_problems(rewards, k=2)
    assert mean == pytest.approx(3 / 12)  # every response's reward, averaged
    # pass@2 per problem: 1 - C(3,2)/C(4,2) = 1/2, 1 - C(2,2)/C(4,2) = 5/6, 0
    assert passed == pytest.approx((0.5 + 5 / 6 + 0.0) / 3)
    # a partly right reward (0.5) adds to the mean but is no right answer for pass@k
    mean, passed = score_problems({0: [0.5, 0.5]}, k=1)
    assert (mean, passed) == (0.5, 0.0)
    with pytest.raises(ValueError, match="no problem"):
        score_problems({}, k=1)
