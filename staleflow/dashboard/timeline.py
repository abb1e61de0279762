"""Append-only logs and the recorder that turns successive observations of a run into
load samples and event markers (Figure 17), shared by the live and simulated sources.

A Pull is seen as an instance's model version changing between two observations, a Push
as the PS version changing, a step as the step count changing; each is stamped with the
time of the observation that first saw it, so markers are exact to the observation
period (one coordinator cycle in the simulator, the poll period of a live run).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from staleflow.dashboard.interface import LoadSample, Page, RunEvent

T = TypeVar("T")


class SeqLog(Generic[T]):
    """A thread-safe log whose items keep their index forever; only the newest
    ``maxlen`` are held, so a week-long run does not grow the server without bound."""

    def __init__(self, maxlen: int = 50_000) -> None:
        self._items: deque[T] = deque(maxlen=maxlen)
        self._total = 0
        self._lock = threading.Lock()

    def append(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            self._total += 1

    def extend(self, items: Iterable[T]) -> None:
        with self._lock:
            for item in items:
                self._items.append(item)
                self._total += 1

    def __len__(self) -> int:
        return self._total

    def last(self) -> T | None:
        with self._lock:
            return self._items[-1] if self._items else None

    def page(self, since: int, limit: int) -> Page[T]:
        with self._lock:
            first = self._total - len(self._items)
            start = min(max(since, first), self._total)
            stop = min(start + limit, self._total)
            items = tuple(self._items[i - first] for i in range(start, stop))
            return Page(start=start, next=stop, total=self._total, first=first, items=items)


@dataclass(frozen=True, slots=True)
class InstanceObservation:
    """What the recorder needs of one instance at one time."""

    inst: int
    version: int
    running: int
    waiting: int
    kv_tokens: int
    tokens_total: int | None  # decoded tokens so far (None: unknown)


class Recorder:
    """Feeds :class:`SeqLog` s of load samples and events from successive observations."""

    def __init__(self, *, every_s: float = 0.0, maxlen: int = 50_000) -> None:
        self.every_s = every_s
        self.load: SeqLog[LoadSample] = SeqLog(maxlen)
        self.events: SeqLog[RunEvent] = SeqLog(maxlen)
        self.rates: dict[int, float] = {}  # measured tokens/s per instance, latest
        self.last_pull: dict[int, float] = {}
        self.last_push: float | None = None
        self._versions: dict[int, int] = {}
        self._tokens: dict[int, tuple[float, int]] = {}
        self._ps: int | None = None
        self._steps: int | None = None
        self._next = float("-inf")

    def observe(
        self,
        now: float,
        instances: Sequence[InstanceObservation],
        *,
        ps_version: int | None,
        steps: int,
    ) -> None:
        self._markers(now, instances, ps_version, steps)
        for o in instances:
            if o.tokens_total is None:
                continue
            t0, tok0 = self._tokens.get(o.inst, (now, o.tokens_total))
            if now > t0:
                self.rates[o.inst] = (o.tokens_total - tok0) / (now - t0)
            if now > t0 or o.inst not in self._tokens:
                self._tokens[o.inst] = (now, o.tokens_total)
        if now + 1e-9 < self._next:
            return
        self._next = now + self.every_s
        self.load.extend(
            LoadSample(
                time=now,
                inst=o.inst,
                version=o.version,
                running=o.running,
                waiting=o.waiting,
                kv_tokens=o.kv_tokens,
                tokens_per_s=self.rates.get(o.inst),
            )
            for o in instances
        )

    def _markers(
        self,
        now: float,
        instances: Sequence[InstanceObservation],
        ps_version: int | None,
        steps: int,
    ) -> None:
        # The first observation is a baseline: a dashboard attached mid-run must not
        # mark every instance as having just Pulled.
        for o in instances:
            before = self._versions.get(o.inst)
            if before is not None and o.version != before:
                self.events.append(RunEvent(now, "pull", o.version, o.inst))
                self.last_pull[o.inst] = now
            self._versions[o.inst] = o.version
        if ps_version is not None:
            if self._ps is not None and ps_version != self._ps:
                self.events.append(RunEvent(now, "push", ps_version))
                self.last_push = now
            self._ps = ps_version
        if self._steps is not None and steps > self._steps:
            # after k steps the trainer has produced version k
            self.events.append(RunEvent(now, "step", steps))
        self._steps = steps
