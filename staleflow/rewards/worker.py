"""The reward worker core: scores finished trajectories, one bad response at a time.

A plain class; a Ray actor (or a thread pool) wraps it. A reward function that raises,
hangs past its limit, or returns something that is not a finite number costs that one
trajectory its reward (0.0, with the reason in ``error``), never the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from staleflow.rewards.base import (
    RewardError,
    RewardFn,
    RewardItem,
    RewardResult,
    RewardTimeout,
    as_reward,
)
from staleflow.rewards.mathverify import require_math_verify
from staleflow.rewards.registry import AUTO, make_reward_fn, reward_spec
from staleflow.rewards.sandbox import TimeLimitedRewardFn

if TYPE_CHECKING:
    from staleflow.config import RewardConfig

logger = logging.getLogger(__name__)

_LOUD_ERRORS = 10  # then one line per failure at debug level: a broken checker floods logs


def build_reward_fn(name: str, timeout_s: float = 0.0) -> RewardFn:
    """The function registered as ``name``; with ``timeout_s > 0`` a function that may
    hang runs in a child process that is killed past the limit (see
    :mod:`staleflow.rewards.sandbox`). Cheap string rewards always run in process."""
    spec = reward_spec(name)
    if timeout_s > 0 and spec.may_hang:
        if name == "math_verify":  # the install hint beats a traceback from the child
            require_math_verify()
        return TimeLimitedRewardFn(spec.factory, timeout_s)
    if spec.may_hang:
        logger.warning(
            "reward %s runs with no time limit (reward.timeout_s=0): one pathological "
            "response can stall its worker",
            name,
        )
    return make_reward_fn(name)


class RewardWorker:
    """Scores :class:`RewardItem` s with one reward function; safe to call from threads."""

    def __init__(self, fn: RewardFn, *, name: str = "") -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._lock = threading.Lock()
        self._scored = 0
        self._errors = 0
        self._timeouts = 0
        self._seconds = 0.0

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardWorker:
        """From the ``reward`` section; ``kind`` must be resolved (not ``auto``)."""
        if config.kind == AUTO:
            raise ValueError(
                "reward.kind='auto' depends on data.task: pass RunConfig.resolved().reward, "
                "or resolve it with staleflow.rewards.resolve_reward_kind"
            )
        return cls(build_reward_fn(config.kind, config.timeout_s), name=config.kind)

    def score_one(self, item: RewardItem) -> RewardResult:
        start = time.perf_counter()
        error, timed_out = "", False
        try:
            reward = as_reward(self.fn(item.response_text, item.answer))
        except Exception as exc:  # any failure is this trajectory's, not the worker's
            reward = 0.0
            error = str(exc) if isinstance(exc, RewardError) else repr(exc)
            timed_out = isinstance(exc, RewardTimeout)
            self._log_failure(item, exc)
        seconds = time.perf_counter() - start
        with self._lock:
            self._scored += 1
            self._seconds += seconds
            self._errors += bool(error)
            self._timeouts += timed_out
        return RewardResult(item.traj_id, reward, error, seconds)

    def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """One result per item, in order."""
        return [self.score_one(item) for item in items]

    def _log_failure(self, item: RewardItem, exc: Exception) -> None:
        with self._lock:
            count = self._errors  # failures before this one
        if count >= _LOUD_ERRORS:
            logger.debug("reward %s failed on trajectory %d: %r", self.name, item.traj_id, exc)
            return
        logger.warning(
            "reward %s failed on trajectory %d, which scores 0.0: %s%s",
            self.name,
            item.traj_id,
            exc if isinstance(exc, RewardError) else repr(exc),
            " (further failures are logged at debug level)" if count + 1 == _LOUD_ERRORS else "",
            # a bug in the function deserves its traceback; a timeout or junk value does not
            exc_info=not isinstance(exc, RewardError),
        )

    def stats(self) -> dict[str, float]:
        """Counters for the dashboard, e.g. ``reward/errors``."""
        with self._lock:
            return {
                "reward/scored": float(self._scored),
                "reward/errors": float(self._errors),
                "reward/timeouts": float(self._timeouts),
                "reward/seconds": self._seconds,
            }

    def close(self) -> None:
        """Release what the function holds (the child process of a time-limited one)."""
        close = getattr(self.fn, "close", None)
        if callable(close):
            close()
