"""The reward contract: a function from a response and its ground truth to a number, and
the records a reward worker takes and returns."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class RewardFn(Protocol):
    """Scores one response against its ground truth; 1.0 is fully correct."""

    def __call__(self, response_text: str, answer: str) -> float: ...


class RewardError(RuntimeError):
    """A reward function could not score a response (it raised, hung or returned junk)."""


class RewardTimeout(RewardError):
    """A reward function ran past its time limit and was stopped."""


@dataclass(frozen=True, slots=True)
class RewardItem:
    """One finished trajectory to score; ``answer`` is its group's ground truth."""

    traj_id: int
    response_text: str
    answer: str


@dataclass(frozen=True, slots=True)
class RewardResult:
    """``error`` is "" when the function scored the response; otherwise it says why not,
    and ``reward`` is 0.0. ``seconds``: wall time spent on this item."""

    traj_id: int
    reward: float
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


def as_reward(value: object) -> float:
    """A reward function's return value as a finite float, or :class:`RewardError`.

    bool counts as a number (checkers often return one); NaN and infinities do not, as
    one of them would poison the group's advantages.
    """
    if not isinstance(value, numbers.Real):
        raise RewardError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardError(f"returned {reward}, not a finite number")
    return reward
