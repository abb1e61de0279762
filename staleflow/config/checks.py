"""The checks every configuration section uses: each raises ``ConfigError`` naming the
dotted key, the value and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.config import ConfigError

# Shared limits of numeric keys, each with why it is what it is (``--help`` shows both).
INT32_MAX = 2**31 - 1
STEPS_WHY = "policy versions count steps and travel as int32 arrays (the per-token versions)"
MAX_ACTORS = 10_000
ACTORS_WHY = "each is a Ray actor; Ray's own release benchmarks stop at 10,000 actors a cluster"
MAX_THREADS = 1024
THREADS_WHY = "threads of one process, all on one node: no node has more cores"
MAX_NODE_GPUS = 64
NODE_GPUS_WHY = "GPUs of one node, where every rank of an instance goes: no node has more"
MAX_SEQUENCE_TOKENS = 2**24
SEQUENCE_WHY = "tokens of one sequence: 16M is above any model's context (the longest, 10M)"
MAX_BATCH_TOKENS = INT32_MAX
BATCH_TOKENS_WHY = "tokens of one batch, indexed by the engines' and trainer's int32 offsets"
MAX_WAIT_S = 7 * 24 * 3600.0
WAIT_WHY = "one week: a longer wait is a stuck run (0, where allowed, waits forever)"


def _help(
    text: str, most: float | None = None, why: str = "", least: float | None = None
) -> dict[str, object]:
    """A field's metadata: its help text and, for a number, the largest value it takes
    (``most``) with why, and the smallest where no section check refuses it already
    (``least``). :func:`staleflow.config.walk.check_tree_bounds` refuses a value outside them
    (NaN and infinities too) before anything starts; ``--help`` prints them."""
    meta: dict[str, object] = {"help": text}
    if most is not None:
        meta["max"] = most
        meta["max_why"] = why
    if least is not None:
        meta["min"] = least
    return meta


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
