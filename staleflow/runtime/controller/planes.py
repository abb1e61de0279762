"""The coordinator's data planes (``coordinator.interface``) over live rollout instances.

The executor takes trajectories from the TS before it Reserves them, but the TS assigns
``V_traj`` only when it routes. So ``take`` only *claims* trajectories of the routing
view (nothing crosses the network); the instance fetches them from the TS itself on
delivery, with the ``V_traj`` just Reserved, and ``submit`` returns those the TS no
longer held (the control loop gives their Reserves back). Interrupted partials go from
the instance to the TS directly, so the executor's ``give_back`` only has claims to
release.

Every call is timed per command kind, for the Pull / Route / Interrupt shares of Table 3.

An instance that is gone (:class:`~staleflow.runtime.interface.InstanceGone`: its process
died, its engine failed, or it left the run) fails no command: the call is reported to
``on_gone`` and does nothing. A Route to it may or may not have reached the TS before it
died, so its trajectories are reported too; the control plane sorts them out with the TS
(``docs/recovery.md``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

from staleflow.runtime.interface import InstanceGone, InstanceHandle
from staleness.types import TrajId

T = TypeVar("T")


class _Claim:
    __slots__ = ()


class _Returned:
    """Marks a trajectory the instance already handed back to the TS."""

    __slots__ = ()


CLAIM, RETURNED = _Claim(), _Returned()


class RuntimePlanes:
    """``EnginePlane``, ``TrajectoryPlane`` and ``ParameterPlane`` at once (thread-safe:
    the control plane runs a round of commands on a thread pool)."""

    def __init__(
        self,
        instances: Mapping[int, InstanceHandle],
        clock: Callable[[], float] = time.perf_counter,
        on_gone: Callable[[InstanceGone, Sequence[TrajId]], None] | None = None,
    ) -> None:
        self.instances = instances
        self._clock = clock
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._claimed: set[TrajId] = set()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.missed_routes = 0

    # -- TrajectoryPlane ---------------------------------------------------------------

    def take(self, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        with self._lock:
            fresh = [t for t in trajs if t not in self._claimed]
            self._claimed.update(fresh)
        return dict.fromkeys(fresh, CLAIM)

    def give_back(self, partials: Mapping[TrajId, object]) -> None:
        with self._lock:
            for tid, payload in partials.items():
                if payload is CLAIM:
                    self._claimed.discard(tid)
                elif payload is not RETURNED:
                    raise TypeError(f"trajectory {tid}: unexpected payload {payload!r}")

    # -- EnginePlane -------------------------------------------------------------------

    def submit(
        self, inst: int, payloads: Mapping[TrajId, object], v_traj: Mapping[TrajId, int]
    ) -> list[TrajId]:
        ids = list(payloads)
        try:
            routed = set(
                self._timed("route", lambda: self.instances[inst].route(ids, dict(v_traj)))
            )
        except InstanceGone as exc:
            with self._lock:
                self._claimed.difference_update(ids)
            self._gone(exc, list(v_traj))  # the initial ones: their Reserves were made
            return []  # not missed: the control plane settles them with the TS
        with self._lock:
            self._claimed.difference_update(ids)
        # No longer QUEUED in the TS: a partial that finished before the Interrupt meant to
        # migrate it reached it, or one whose group was consumed or aborted since the
        # cycle's view.
        missed = [tid for tid in ids if tid not in routed]
        with self._lock:
            self.missed_routes += len(missed)
        return missed

    def interrupt(self, inst: int, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        try:
            returned = self._timed("interrupt", lambda: self.instances[inst].interrupt(list(trajs)))
        except InstanceGone as exc:  # the TS takes them back from the lost instance
            self._gone(exc, ())
            return {}
        return dict.fromkeys(returned, RETURNED)

    def abort(self, inst: int, trajs: Sequence[TrajId]) -> Collection[TrajId]:
        try:
            return self._timed("abort", lambda: self.instances[inst].abort(list(trajs)))
        except InstanceGone as exc:
            self._gone(exc, ())
            return []

    # -- ParameterPlane ----------------------------------------------------------------

    def pull(self, inst: int, at_least: int) -> int:
        try:
            return self._timed("pull", lambda: self.instances[inst].pull(at_least))
        except InstanceGone as exc:  # its successor Pulls when it starts
            self._gone(exc, ())
            return at_least

    def _gone(self, exc: InstanceGone, routed: Sequence[TrajId]) -> None:
        if self._on_gone is None:
            raise exc
        self._on_gone(exc, routed)

    def _timed(self, kind: str, call: Callable[[], T]) -> T:
        started = self._clock()
        try:
            return call()
        finally:
            elapsed = self._clock() - started
            with self._lock:
                self.seconds[kind] += elapsed
                self.calls[kind] += 1
