"""Math answers compared as mathematics through HuggingFace's ``math-verify``.

``math_verify`` enforces its own time limits with ``signal.alarm``, which works only in
a process's main thread and raises elsewhere; reward workers score in threads and Ray
actors. We therefore disable its timeouts (``parsing_timeout=None``,
``timeout_seconds=None``) and enforce ``reward.timeout_s`` from outside, by running the
function in a child process that is killed past the deadline
(:mod:`staleflow.rewards.sandbox`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

from staleflow.install import missing

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    missing("the math_verify reward's package math-verify") + " (or pick reward.kind=exact)"
)


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    # math-verify warns once that its own timeout is off; callers of this module are told
    # by staleflow.rewards.worker whether reward.timeout_s limits it instead
    return not record.getMessage().startswith("Timeout is disabled")


def require_math_verify() -> None:
    """Fail with the install hint, without paying for the import (sympy, ANTLR)."""
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(INSTALL_HINT)


class MathVerifyReward:
    """1.0 when the response's final answer equals the ground truth mathematically
    (``0.5`` and ``\\frac{1}{2}``, ``1,000`` and ``1000``, a ``\\boxed{}`` answer).

    A ground truth that math-verify cannot read (plain words) falls back to an exact,
    stripped text comparison rather than rewarding nothing forever.
    """

    def __init__(
        self,
        *,
        float_rounding: int = 6,
        numeric_precision: int = 15,
        strict: bool = True,
        answer_cache_size: int = 4096,
    ) -> None:
        try:
            import math_verify
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        for name in ("math_verify.parser", "math_verify.grader"):
            target = logging.getLogger(name)
            if _drop_timeout_notice not in target.filters:
                target.addFilter(_drop_timeout_notice)
        self._parse = math_verify.parse
        self._verify = math_verify.verify
        self._verify_options: dict[str, Any] = {
            "float_rounding": float_rounding,
            "numeric_precision": numeric_precision,
            "strict": strict,
            "timeout_seconds": None,
        }
        # every trajectory of a group shares its ground truth: parse it once
        self._gold = functools.lru_cache(maxsize=answer_cache_size)(self._parse_gold)

    def _parse_gold(self, answer: str) -> list[Any]:
        text = answer.strip()
        # ground truths are usually bare LaTeX ("\frac12", "x^2+1"), which math-verify
        # only reads between math delimiters
        if "$" not in text and "\\boxed" not in text:
            gold = self._parse(f"${text}$", parsing_timeout=None)
            if gold:
                return gold
        return self._parse(text, parsing_timeout=None)

    def __call__(self, response_text: str, answer: str) -> float:
        gold = self._gold(answer)
        if not gold:
            logger.debug("math-verify cannot parse the answer %r; comparing text", answer)
            return 1.0 if response_text.strip() == answer.strip() else 0.0
        predicted = self._parse(response_text, parsing_timeout=None)
        if not predicted:
            return 0.0
        return 1.0 if self._verify(gold, predicted, **self._verify_options) else 0.0
