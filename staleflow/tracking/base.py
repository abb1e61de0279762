"""The one interface every experiment tracker implements, and the fan-out the launch
driver holds.

A tracker receives the resolved configuration once (:meth:`Tracker.log_config`), the
flat step record of every training step (:meth:`Tracker.log_step`: the keys of
``metrics.jsonl``) and the run's summary once it ends (:meth:`Tracker.log_summary`).
``metrics.jsonl`` stays the record of the run: a tracker that fails while the run trains
is logged and dropped, never allowed to stop the run (:class:`Trackers`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Tracker(Protocol):
    name: str

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved run configuration (nested sections), once, before the first step."""
        ...

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """One training step's flat record (``area/name`` keys, as in metrics.jsonl)."""
        ...

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (what ``summary.json`` holds), once, at the end."""
        ...

    def close(self, *, failed: bool) -> None: ...


def flatten(tree: Mapping[str, Any], sep: str = ".", prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` pairs of a nested mapping, in order."""
    for key, value in tree.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from flatten(value, sep, name)
        else:
            yield name, value


def numbers(tree: Mapping[str, Any], sep: str = "/") -> dict[str, float]:
    """The finite numeric leaves of a nested mapping (booleans left out), by joined key:
    what a tracker can chart of a summary."""
    out: dict[str, float] = {}
    for key, value in flatten(tree, sep):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class Trackers:
    """Every tracker of a run as one: each call goes to each tracker in turn. A tracker
    that raises is logged (with its name and the exception) and dropped for the rest of
    the run: the run and the other trackers go on, ``metrics.jsonl`` holds every step."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self._trackers = list(trackers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._trackers]

    def __bool__(self) -> bool:
        return bool(self._trackers)

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._trackers):
            try:
                call(tracker)
            except Exception:
                logger.exception(
                    "the %s tracker failed in %s and is dropped for the rest of the run "
                    "(metrics.jsonl still holds every step)",
                    tracker.name,
                    what,
                )
                self._trackers.remove(tracker)
                try:
                    tracker.close(failed=True)
                except Exception:
                    logger.debug("closing the failed %s tracker failed too", tracker.name)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each("log_config", lambda t: t.log_config(config))

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._each("log_step", lambda t: t.log_step(step, metrics))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._each("log_summary", lambda t: t.log_summary(summary))

    def close(self, *, failed: bool = False) -> None:
        self._each("close", lambda t: t.close(failed=failed))
        self._trackers.clear()
