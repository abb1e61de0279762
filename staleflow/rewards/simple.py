"""Rewards that are plain string comparisons: cheap, total, and never hang."""

from __future__ import annotations

from staleflow.data.synthetic import extract_answer
from staleflow.rewards.base import RewardFn


def arithmetic(response_text: str, answer: str) -> float:
    """The built-in task: the text after the response's last ``=`` equals the answer.

    The model may show its work (``12+7=19``) but only the final result counts, and it
    must match exactly: ``19.0`` or ``19 apples`` get nothing.
    """
    return 1.0 if extract_answer(response_text) == answer.strip() else 0.0


def exact(response_text: str, answer: str) -> float:
    """The whole response, stripped, equals the answer, stripped."""
    return 1.0 if response_text.strip() == answer.strip() else 0.0


def make_arithmetic() -> RewardFn:
    return arithmetic


def make_exact() -> RewardFn:
    return exact
