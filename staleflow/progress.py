"""Progress of the long waits before training starts: the warm-up, the initial scoring,
the actor start-up and the first buffer.

A :class:`Progress` holds one :class:`Phase` per wait, in order, and tells its renderers
when one starts, advances and finishes. Library code only reports (``phase.advance(loss=
...)``); what the user sees is the renderers' business: a live bar in a terminal
(:class:`staleflow.runtime.driver.display.TerminalProgress`), plain periodic lines when output
is a log (:class:`PlainLines`), the dashboard's phase line (:class:`LatestLine`). A library
call given no ``Progress`` reports to :data:`SILENT`, a ``Progress`` that keeps no state
and prints nothing. Standard library only, thread-safe (the dashboard reads from its own thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import IO, Any, Protocol


@dataclass(frozen=True, slots=True)
class PhaseState:
    """One wait as it stands. ``total`` None: no count is known (a spinner, no bar).
    ``upper_bound``: the phase may end before ``total`` (a warm-up that stops at a target
    accuracy), so ``left_s`` is an upper bound ("at most ... left")."""

    key: str
    label: str
    unit: str
    done: float
    total: float | None
    upper_bound: bool
    metrics: Mapping[str, float]
    goal: str  # what ends the phase early, e.g. "accuracy 25%"
    started_s: float  # on the Progress clock
    elapsed_s: float
    detail: str = ""  # what it is doing now, e.g. "rollout instances"
    finished: bool = False
    failed: bool = False
    note: str = ""  # the closing remark of a finished phase

    @property
    def left_s(self) -> float | None:
        """Seconds left at the rate so far; None before the first step or without a total."""
        if self.finished or self.total is None or self.done <= 0 or self.elapsed_s <= 0:
            return None
        return max(0.0, self.total - self.done) * self.elapsed_s / self.done

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the dashboard's ``phases``)."""
        return {
            "key": self.key,
            "label": self.label,
            "unit": self.unit,
            "done": self.done,
            "total": self.total,
            "upper_bound": self.upper_bound,
            "metrics": dict(self.metrics),
            "goal": self.goal,
            "detail": self.detail,
            "elapsed_s": round(self.elapsed_s, 3),
            "left_s": None if self.left_s is None else round(self.left_s, 3),
            "finished": self.finished,
            "failed": self.failed,
            "note": self.note,
        }


class Renderer(Protocol):
    """Shows phases; called with the phase's new state, under no lock of the caller."""

    def started(self, state: PhaseState) -> None: ...

    def updated(self, state: PhaseState) -> None: ...

    def finished(self, state: PhaseState) -> None: ...


class Phase:
    """One wait being reported; a context manager that finishes it (as failed when the
    block raises)."""

    def __init__(self, owner: Progress | None, state: PhaseState) -> None:
        self._owner = owner
        self._state = state

    @property
    def state(self) -> PhaseState:
        return self._state

    def advance(self, n: float = 1, *, detail: str | None = None, **metrics: float) -> None:
        """``n`` more units done; ``metrics`` (loss, accuracy ...) replace earlier values."""
        if self._owner is not None:
            self._owner._change(self, n, None, None, detail, metrics)

    def update(
        self,
        *,
        done: float | None = None,
        total: float | None = None,
        detail: str | None = None,
        **metrics: float,
    ) -> None:
        """Set what is given (``done``, ``total``, ``detail``, metrics); keep the rest."""
        if self._owner is not None:
            self._owner._change(self, 0, done, total, detail, metrics)

    def finish(self, note: str = "", *, failed: bool = False) -> None:
        if self._owner is not None:
            self._owner._finish(self, note, failed)

    def __enter__(self) -> Phase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.finish()
        else:
            self.finish(f"stopped: {type(exc).__name__}", failed=True)


class Progress:
    """The phases of one run, in the order they started."""

    def __init__(
        self,
        *renderers: Renderer,
        clock: Callable[[], float] = time.monotonic,
        keep: bool = True,
    ) -> None:
        """``keep=False``: phases report nothing and are not kept (:data:`SILENT`)."""
        self._renderers: list[Renderer] = list(renderers)
        self._keep = keep
        self._clock = clock
        self._lock = threading.Lock()
        self._phases: list[Phase] = []

    def add_renderer(self, renderer: Renderer) -> None:
        """Renderers added later (the dashboard) read earlier phases from :meth:`snapshot`."""
        with self._lock:
            self._renderers.append(renderer)

    def phase(
        self,
        key: str,
        label: str,
        *,
        total: float | None = None,
        unit: str = "",
        upper_bound: bool = False,
        goal: str = "",
    ) -> Phase:
        """Start reporting a wait: ``key`` names it for programs (``warmup``, ``scoring``,
        ``actors``, ``first_buffer``), ``label`` for people."""
        now = self._clock()
        state = PhaseState(
            key=key,
            label=label,
            unit=unit,
            done=0,
            total=total,
            upper_bound=upper_bound,
            metrics={},
            goal=goal,
            started_s=now,
            elapsed_s=0.0,
        )
        if not self._keep:
            return Phase(None, state)
        phase = Phase(self, state)
        with self._lock:
            self._phases.append(phase)
            renderers = tuple(self._renderers)
        for r in renderers:
            r.started(state)
        return phase

    def snapshot(self) -> list[PhaseState]:
        """Every phase so far; running ones with their elapsed time as of now."""
        now = self._clock()
        with self._lock:
            states = [p._state for p in self._phases]
        return [s if s.finished else replace(s, elapsed_s=now - s.started_s) for s in states]

    def current(self) -> PhaseState | None:
        """The latest phase still running, if any."""
        running = [s for s in self.snapshot() if not s.finished]
        return running[-1] if running else None

    def _change(
        self,
        phase: Phase,
        add: float,
        done: float | None,
        total: float | None,
        detail: str | None,
        metrics: Mapping[str, float],
    ) -> None:
        now = self._clock()
        with self._lock:  # read-modify-write: concurrent advances all count
            old = phase._state
            if old.finished:
                return
            state = replace(
                old,
                done=(old.done if done is None else done) + add,
                total=old.total if total is None else total,
                detail=old.detail if detail is None else detail,
                metrics={**old.metrics, **metrics},
                elapsed_s=now - old.started_s,
            )
            phase._state = state
            renderers = tuple(self._renderers)
        for r in renderers:
            r.updated(state)

    def _finish(self, phase: Phase, note: str, failed: bool) -> None:
        now = self._clock()
        with self._lock:
            old = phase._state
            if old.finished:
                return
            state = replace(
                old, elapsed_s=now - old.started_s, finished=True, failed=failed, note=note
            )
            phase._state = state
            renderers = tuple(self._renderers)
        for r in renderers:
            r.finished(state)


SILENT = Progress(keep=False)  # what library calls report to when given no Progress
SILENT_PHASE = SILENT.phase("silent", "")  # a phase that reports nothing


# -- plain text -----------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def metric_text(name: str, value: float) -> str:
    """Shares (accuracy, reward) as percentages, the rest with 4 significant digits."""
    if name == "reward" or name.endswith("accuracy"):
        return f"{name} {value:.1%}"
    return f"{name} {value:.4g}"


def count_text(state: PhaseState) -> str:
    """``125/1200 steps``, or ``125 steps`` when no total is known."""
    done = f"{state.done:g}"
    unit = f" {state.unit}" if state.unit else ""
    if state.total is None:
        return f"{done}{unit}"
    total = f"{state.total:g}"
    return f"{done}/{total}{unit}"


def left_text(state: PhaseState) -> str:
    left = state.left_s
    if left is None:
        return ""
    return f"at most {duration(left)} left" if state.upper_bound else f"~{duration(left)} left"


def progress_line(state: PhaseState) -> str:
    """One self-contained line: what, how far, the metrics, the time spent and left."""
    if state.finished:
        head = "failed" if state.failed else "done"
        parts = [f"{head} in {duration(state.elapsed_s)}", count_text(state)]
        parts += [metric_text(k, v) for k, v in state.metrics.items()]
        if state.note:
            parts.append(state.note)
        return f"{state.label}: " + ", ".join(p for p in parts if p)
    parts = [count_text(state)]
    if state.total and state.done:
        parts[0] += f" ({state.done / state.total:.0%})"
    if state.detail:
        parts.append(state.detail)
    parts += [metric_text(k, v) for k, v in state.metrics.items()]
    if state.goal:
        parts.append(f"stops at {state.goal}")
    parts.append(f"{duration(state.elapsed_s)} elapsed")
    parts.append(left_text(state))
    return f"{state.label}: " + ", ".join(p for p in parts if p)


@dataclass
class PlainLines:
    """A line when a phase starts, one at most every ``every_s`` seconds while it runs,
    and one when it ends: for logs, CI and ``nohup`` (no cursor movement, no colour)."""

    stream: IO[str]
    every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _last: dict[tuple[str, float], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self, state: PhaseState) -> None:
        extra = []
        if state.total is not None:
            bound = "at most " if state.upper_bound else ""
            extra.append(f"{bound}{state.total:g} {state.unit}".rstrip())
        if state.goal:
            extra.append(f"stops at {state.goal}")
        self._write(f"{state.label} ..." + (f" ({', '.join(extra)})" if extra else ""))
        with self._lock:
            self._last[state.key, state.started_s] = self.clock()

    def updated(self, state: PhaseState) -> None:
        now = self.clock()
        key = (state.key, state.started_s)
        with self._lock:
            if now - self._last.setdefault(key, now) < self.every_s:
                return
            self._last[key] = now
        self._write(progress_line(state))

    def finished(self, state: PhaseState) -> None:
        with self._lock:
            self._last.pop((state.key, state.started_s), None)
        self._write(progress_line(state))

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class LatestLine:
    """Hands ``show`` the line of whichever phase changed last (``staleflow launch`` gives
    it the dashboard's phase field, so the page shows the same waits as the terminal)."""

    def __init__(self, show: Callable[[str], None]) -> None:
        self.show = show

    def started(self, state: PhaseState) -> None:
        self.show(progress_line(state))

    def updated(self, state: PhaseState) -> None:
        self.show(progress_line(state))

    def finished(self, state: PhaseState) -> None:
        self.show(progress_line(state))
