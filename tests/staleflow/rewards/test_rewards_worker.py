"""The reward worker: one result per item, and a broken function never crashes it."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from staleflow.config import RewardConfig, RunConfig
from staleflow.rewards import RewardItem, RewardResult, RewardWorker, arithmetic


def _flaky(response_text: str, answer: str) -> float:
    if response_text == "raise":
        raise ZeroDivisionError("division by zero in the checker")
    if response_text == "nan":
        return math.nan
    if response_text == "none":
        return None  # type: ignore[return-value]
    return arithmetic(response_text, answer)


def test_scores_in_order_with_timings():
    worker = RewardWorker(arithmetic)
    items = [RewardItem(10, "12+7=19", "19"), RewardItem(11, "20", "19")]
    results = worker.score(items)
    assert [(r.traj_id, r.reward, r.error) for r in results] == [(10, 1.0, ""), (11, 0.0, "")]
    assert all(isinstance(r, RewardResult) and r.ok and r.seconds >= 0 for r in results)
    assert worker.score([]) == []


def test_a_failing_function_costs_only_its_trajectory():
    worker = RewardWorker(_flaky, name="flaky")
    items = [
        RewardItem(1, "19", "19"),
        RewardItem(2, "raise", "19"),
        RewardItem(3, "nan", "19"),
        RewardItem(4, "none", "19"),
        RewardItem(5, "7=19", "19"),
    ]
    results = worker.score(items)
    assert [r.traj_id for r in results] == [1, 2, 3, 4, 5]
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert results[1].error == "ZeroDivisionError('division by zero in the checker')"
    assert "not a finite number" in results[2].error
    assert "not a number" in results[3].error
    assert results[0].ok and results[4].ok and not results[1].ok
    stats = worker.stats()
    assert stats["reward/scored"] == 5 and stats["reward/errors"] == 3
    assert stats["reward/timeouts"] == 0


def test_failures_log_loudly_then_quietly(caplog):
    worker = RewardWorker(_flaky, name="flaky")
    with caplog.at_level(logging.DEBUG, logger="staleflow.rewards.worker"):
        worker.score([RewardItem(i, "raise", "1") for i in range(15)])
    levels = [r.levelno for r in caplog.records]
    assert levels.count(logging.WARNING) == 10 and levels.count(logging.DEBUG) == 5
    assert "further failures are logged at debug level" in caplog.records[9].getMessage()
    assert caplog.records[0].exc_info is not None  # a bug in the checker gets its traceback


def test_concurrent_callers():
    worker = RewardWorker(_flaky)
    items = [RewardItem(i, "raise" if i % 3 == 0 else "19", "19") for i in range(60)]
    out: list[list[RewardResult]] = []
    threads = [threading.Thread(target=lambda: out.append(worker.score(items))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(
        [r.reward for r in res] == [0.0 if i % 3 == 0 else 1.0 for i in range(60)] for res in out
    )
    assert worker.stats()["reward/scored"] == 240 and worker.stats()["reward/errors"] == 80


def test_from_config():
    worker = RewardWorker.from_config(RunConfig().resolved().reward)
    assert worker.fn is arithmetic and worker.name == "arithmetic"
    assert worker.score([RewardItem(1, "3", "3")])[0].reward == 1.0
    worker.close()  # nothing to release; must not fail
    with pytest.raises(ValueError, match=r"RunConfig.resolved\(\).reward"):
        RewardWorker.from_config(RewardConfig())
