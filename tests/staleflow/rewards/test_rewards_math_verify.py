"""The math_verify reward: equivalent answers, threads, and the time-limited child."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("math_verify")

from staleflow.config import RewardConfig
from staleflow.rewards import RewardItem, RewardWorker, TimeLimitedRewardFn
from staleflow.rewards.mathverify import MathVerifyReward

CASES = [
    ("0.5", r"\frac{1}{2}", 1.0),
    (r"The answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
    ("1/2", r"\frac12", 1.0),
    ("so there are 1,000 apples", "1000", 1.0),
    (r"$x^2+1$", "x^2+1", 1.0),
    ("I think 3", "72", 0.0),
    ("", "72", 0.0),
    ("0.51", r"\frac{1}{2}", 0.0),
]


@pytest.fixture(scope="module")
def reward() -> MathVerifyReward:
    return MathVerifyReward()


@pytest.mark.parametrize(("response", "answer", "expected"), CASES)
def test_equivalent_answers(reward, response, answer, expected):
    assert reward(response, answer) == expected


def test_unparseable_ground_truth_falls_back_to_text(reward):
    assert reward("Paris", r"\text{}") == 0.0
    assert reward(" ", "") == 1.0


def test_runs_in_threads(reward):
    # math-verify's own timeouts use signal.alarm, which raises outside the main thread
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: reward(c[0], c[1]), CASES * 3))
    assert got == [c[2] for c in CASES] * 3


def test_worker_from_config_runs_it_in_a_time_limited_child():
    worker = RewardWorker.from_config(RewardConfig(kind="math_verify", timeout_s=30.0))
    try:
        assert isinstance(worker.fn, TimeLimitedRewardFn)
        items = [RewardItem(i, r, a) for i, (r, a, _) in enumerate(CASES)]
        results = worker.score(items)
        assert [r.reward for r in results] == [c[2] for c in CASES]
        assert all(r.ok for r in results)
    finally:
        worker.close()


def test_no_time_limit_runs_in_process():
    worker = RewardWorker.from_config(RewardConfig(kind="math_verify", timeout_s=0.0))
    assert isinstance(worker.fn, MathVerifyReward)
    assert worker.score([RewardItem(7, "0.5", r"\frac{1}{2}")])[0].reward == 1.0
