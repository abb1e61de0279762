"""The checks every configuration section uses: each raises ``ConfigError`` naming the
dotted key, the value and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.config import ConfigError


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def require(ok: bool, key: str, value: object, fix: str) -> None:
    """Raise ``ConfigError("<key>=<value> <fix>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r} {fix}")


def require_choice(key: str, value: str, choices: Sequence[str], what: str = "") -> None:
    require(
        value in choices,
        key,
        value,
        f"is unknown: use one of {' | '.join(choices)}" + (f" ({what})" if what else ""),
    )


def require_at_least(key: str, value: float, low: float, what: str) -> None:
    require(value >= low, key, value, f"is too small: use at least {low:g} {what}")


def require_positive(key: str, value: float, example: str) -> None:
    require(math.isfinite(value) and value > 0, key, value, f"must be > 0, e.g. {example}")
