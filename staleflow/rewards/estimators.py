"""What an evaluation reports from the rewards of its responses: mean@k and the unbiased
pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code").

For a problem with ``n`` sampled responses of which ``c`` are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

is the probability that at least one of ``k`` responses drawn without replacement from
the ``n`` is correct: an unbiased estimate of the chance that ``k`` fresh samples solve it,
with less variance than drawing exactly ``k``. The evaluation's pass@k is its mean over
problems; mean@k is the mean reward over every response. A response is correct when its
reward is at least :data:`CORRECT` (a reward function gives 1.0 for a fully right answer,
``staleflow.rewards.base.RewardFn``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CORRECT = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)`` in exact integer arithmetic; ``ValueError`` unless
    ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a correct one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True, slots=True)
class EvalScores:
    """One evaluation of the policy on the held-out set.

    ``mean_at_k``: mean reward over the ``problems`` x ``samples`` responses.
    ``pass_at_k``: the mean over problems of :func:`pass_at_k` at ``k``.
    ``version_min`` / ``version_max``: the oldest and newest policy version that sampled
    a token of the responses (an instance may Pull while the evaluation runs).
    ``seconds``: from the evaluation's start to its last score."""

    mean_at_k: float
    pass_at_k: float
    k: int
    samples: int
    problems: int
    version_min: int
    version_max: int
    seconds: float


def score_problems(rewards: Mapping[int, Sequence[float]], k: int) -> tuple[float, float]:
    """(mean@k, pass@k) of the responses' rewards by problem; every problem has at least
    ``k`` responses. ``ValueError`` when there is no problem."""
    if not rewards:
        raise ValueError("no problem was scored")
    total = sum(len(r) for r in rewards.values())
    mean = sum(sum(r) for r in rewards.values()) / total
    passed = sum(pass_at_k(len(r), sum(x >= CORRECT for x in r), k) for r in rewards.values())
    return mean, passed / len(rewards)
