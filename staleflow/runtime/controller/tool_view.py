"""What the coordinator's rules for multi-turn work read in a real run: tool waits.

The rules (``coordinator/agentic.py``) read two fields of each instance's snapshot that
an engine cannot report, because a trajectory waiting on its tool is on no instance:

- ``env_trajs``: the trajectories whose last model turn ended on the instance and which
  wait on their environment now. The TS knows them: a finished turn is handed to a reward
  worker (REWARDING) with the instance it ended on (``TrajectoryServer.tool_waits``), and
  in a multi-turn task every REWARDING trajectory waits on its environment (a tool call,
  then its next turn or its score: ``runtime/workers/env_stage.py``).
- ``held``: the prefixes the instance still caches. The embedded engine lists what its
  prefix store keeps (``engines.base.KeepsPrefixes``), evictions included, and its
  instance reports that list (``held_exact``): the view keeps it as it is. vLLM's
  prefix caching and SGLang's radix cache keep a finished turn's KV too, but keyed by
  token blocks, not by trajectory, so for them the view assumes: a prefix stays until
  the instance Pulls, the trajectory is routed again or its episode ends (an eviction
  is not seen; the routing's gain rule still weighs the prefill).

An episode that ends (:meth:`ToolWaitView.rewarded`) needs its prefix no more: the view
forgets it and asks each instance that lists it (the one of its last turn, and one an
earlier turn moved away from) to drop it, which frees the embedded engine's store for
the next turns of episodes still running (it would otherwise keep the ended one until
evicted).

The coordinator learns tool waits online from ``env_trajs`` (``ToolWaits.observe``);
:meth:`ToolWaitView.learn` warm-starts that estimate from the episodes' own records
(``Rewarded.tool_wait_s`` over ``tool_calls``) until the snapshots have measured enough.

Pure: fed the TS's list and the instances' snapshots, it returns snapshots; no Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol, cast

from coordinator.agentic import ToolWaits
from coordinator.types import InstanceSnapshot, TrajRecord
from staleflow.runtime.controller.instances import Members
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.interface import InstanceGone, Rewarded
from trajectory_server.types import InstanceId, RoutableTrajectory

logger = logging.getLogger(__name__)

ToolWaitList = Sequence[tuple[RoutableTrajectory, InstanceId]]


class ToolWaitSource(Protocol):
    """The part of the TS the view reads (the TS client serves it)."""

    def tool_waits(self) -> ToolWaitList: ...


class ToolWaitView:
    """See the module docstring. ``holders()``: each member instance's TS holder id (the
    id its turns are handed over with). ``prefix_cache``: the engines keep a finished
    request's KV (vLLM, SGLang), so ``held`` is reported."""

    # prefixes remembered for next turns not routed yet; beyond this the oldest go (a
    # trajectory that ended its episode is never routed again)
    MAX_HELD = 65_536

    def __init__(
        self,
        source: ToolWaitSource,
        holders: Callable[[], Mapping[int, InstanceId]],
        *,
        prefix_cache: bool,
    ) -> None:
        self._source = source
        self._holders = holders
        self.prefix_cache = prefix_cache
        # trajectory -> (instance, its version when the turn ended there, KV tokens)
        self._held: dict[int, tuple[int, int, int]] = {}
        # instances that list their own prefixes, their lists in the last snapshots, and
        # where each prefix is listed (indexed once an episode ends): only their engines
        # can drop one
        self._exact: set[int] = set()
        self._lists: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._listed: dict[int, list[int]] | None = None
        self.learned = 0  # waits taken from records

    def waiting(self) -> ToolWaitList:
        """The TS's list; ask it before gathering the snapshots (:meth:`merge`)."""
        return self._source.tool_waits()

    def merge(
        self, snapshots: Sequence[InstanceSnapshot], waiting: ToolWaitList
    ) -> list[InstanceSnapshot]:
        """``snapshots`` with ``env_trajs`` (and ``held``) filled in from ``waiting``.
        The TS was asked first, and routes are decided on this thread after both, so a
        trajectory it lists is on no instance; one that is anyway (a list older than the
        snapshot) is left out."""
        inst_of = {h: i for i, h in self._holders().items()}
        on = {t.traj_id for s in snapshots for t in (*s.run_trajs, *s.wait_trajs)}
        versions = {s.inst: s.inst_version for s in snapshots}
        # an instance that lists its prefixes is not assumed about
        exact = self._exact = {s.inst for s in snapshots if s.held_exact}
        self._lists = [(s.inst, s.held) for s in snapshots if s.held_exact and s.held]
        self._listed = None  # most cycles end no episode: indexed on demand (rewarded)
        env: dict[int, list[TrajRecord]] = {}
        for r, holder in waiting:
            inst = inst_of.get(holder)
            if inst is None or inst not in versions or r.traj_id in on:
                continue  # the instance left the run, or the list is older than the snapshot
            env.setdefault(inst, []).append(TrajRecord(*r))
            if self.prefix_cache and inst not in exact and r.traj_id not in self._held:
                self._held[r.traj_id] = (inst, versions[inst], r.length)
        held: dict[int, list[tuple[int, int]]] = {}
        if self.prefix_cache:
            self._forget(on, versions)
            for tid, (inst, _, length) in self._held.items():
                held.setdefault(inst, []).append((tid, length))
        return [
            replace(
                s,
                env_trajs=tuple(env.get(s.inst, ())),
                held=s.held if s.held_exact else tuple(held.get(s.inst, ())),
            )
            if s.inst in env or s.inst in held
            else s
            for s in snapshots
        ]

    def rewarded(
        self, records: Sequence[Rewarded], waits: ToolWaits | None, members: Members
    ) -> int:
        """Episodes that ended (the control plane Occupies them): :meth:`learn` from
        their records, forget their prefixes, and ask each instance that lists one (its
        last turn's, and one an earlier turn left behind) to drop it: a hint, so an
        instance that left is skipped. Engines that list none cannot drop one (vLLM,
        SGLang: their caches evict by block). Returns the drops asked for."""
        self.learn(records, waits)
        if not self.prefix_cache:
            return 0  # the engines keep no prefix
        if self._listed is None:
            self._listed = {}
            for inst, held in self._lists:
                for tid, _ in held:
                    self._listed.setdefault(tid, []).append(inst)
        drops: dict[int, list[int]] = {}
        for r in records:
            self._held.pop(r.traj_id, None)
            where = self._listed.get(r.traj_id, [])
            if r.instance in self._exact and r.instance not in where:
                where = [*where, r.instance]  # its last turn ended after the snapshots
            for inst in where:
                drops.setdefault(inst, []).append(r.traj_id)
        for inst, tids in drops.items():
            try:
                members[inst].drop_prefixes(tids)
            except InstanceGone:
                continue  # its prefixes went with it
        return sum(map(len, drops.values()))

    def _forget(self, on: set[int], versions: Mapping[int, int]) -> None:
        """Drop the prefixes a Pull emptied (the instance's version moved), those of
        trajectories routed again (the engine holds them as running work now) and those
        of instances gone."""
        drop = [
            tid
            for tid, (inst, version, _) in self._held.items()
            if tid in on or versions.get(inst) != version
        ]
        for tid in drop:
            del self._held[tid]
        while len(self._held) > self.MAX_HELD:
            del self._held[next(iter(self._held))]

    def learn(self, records: Sequence[Rewarded], waits: ToolWaits | None) -> None:
        """Warm-start ``waits`` from finished episodes' records (the mean of each episode's
        tool calls, once per call) until the snapshots have measured ``min_samples``
        waits of their own: those include the time a finished turn queues for a worker,
        which the records do not."""
        if waits is None or waits.samples >= waits.min_samples:
            return
        got = [
            r.tool_wait_s / r.tool_calls
            for r in records
            if r.tool_calls > 0 and r.tool_wait_s >= 0
            for _ in range(r.tool_calls)
        ]
        if got:
            waits.learn(got)
            self.learned += len(got)


def tool_view(config: ControlConfig, ts: object, members: Members) -> ToolWaitView | None:
    """The control plane's view (``ControlConfig.tool_waits``; the TS client serves
    ``tool_waits``), or None for a single-turn task."""
    if not config.tool_waits:
        return None
    return ToolWaitView(cast(ToolWaitSource, ts), members.holders, prefix_cache=config.prefix_cache)
