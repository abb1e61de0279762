"""Time limits enforced by a killable child process."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow.rewards import (
    RewardError,
    RewardItem,
    RewardTimeout,
    RewardWorker,
    TimeLimitedRewardFn,
)

FACTORY = "reward_helpers:make_misbehaving"


@pytest.fixture(scope="module")
def helpers_on_path():
    # the spawned child inherits sys.path, so it can import reward_helpers too
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).parent))
        yield


@pytest.fixture(scope="module")
def limited(helpers_on_path):
    # shared: every child start costs a Python start-up and imports
    fn = TimeLimitedRewardFn(FACTORY, timeout_s=1.0)
    yield fn
    fn.close()


def test_scores_in_the_child(limited):
    assert limited("19", "19") == 1.0
    assert limited("20", "19") == 0.0


def test_a_hang_is_cut_at_the_limit_and_the_child_replaced(limited):
    first, restarts = limited.pid, limited.restarts
    # uncut, the child would answer after its 120 s sleep: no RewardTimeout
    with pytest.raises(RewardTimeout, match=r"timed out after 1s"):
        limited("hang", "19")
    assert limited.pid is None and limited.restarts == restarts + 1
    assert limited("19", "19") == 1.0  # a fresh child
    assert limited.pid not in (None, first)


def test_a_crash_or_an_exception_in_the_child(limited):
    limited("a", "a")
    pid, restarts = limited.pid, limited.restarts
    with pytest.raises(RewardError, match=r"ValueError\('boom'\)"):
        limited("boom", "x")
    assert (limited.pid, limited.restarts) == (pid, restarts)  # the child keeps running
    with pytest.raises(RewardError, match="returned str 'yes', not a number"):
        limited("junk", "x")
    with pytest.raises(RewardError, match=r"died \(exit code 3\)"):
        limited("crash", "x")
    assert limited("ok", "ok") == 1.0


def test_the_worker_records_timeouts(helpers_on_path):
    worker = RewardWorker(TimeLimitedRewardFn(FACTORY, timeout_s=0.5), name="misbehaving")
    try:
        results = worker.score(
            [RewardItem(1, "a", "a"), RewardItem(2, "hang", "a"), RewardItem(3, "b", "b")]
        )
    finally:
        worker.close()
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    assert results[1].error == "timed out after 0.5s"
    stats = worker.stats()
    assert stats["reward/timeouts"] == 1 and stats["reward/errors"] == 1
    assert stats["reward/seconds"] == pytest.approx(sum(r.seconds for r in results))


def test_a_function_that_cannot_be_built_fails_at_construction(helpers_on_path):
    with pytest.raises(ImportError, match="imaginary"):
        TimeLimitedRewardFn("reward_helpers:make_unbuildable", timeout_s=1.0)
    with pytest.raises(RewardError, match="cannot start"):
        TimeLimitedRewardFn("reward_helpers:no_such_factory", timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        TimeLimitedRewardFn(FACTORY, timeout_s=0)


def test_close_stops_the_child(helpers_on_path):
    fn = TimeLimitedRewardFn(FACTORY, timeout_s=1.0)
    process = fn._child.process
    fn.close()
    assert not process.is_alive()
    assert fn("a", "a") == 1.0  # a call after close starts a new child
    fn.close()
