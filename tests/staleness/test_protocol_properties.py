"""Long random sequences of protocol operations against a bookkeeping model.

An export/restore round trip may happen at any point: from then on every call runs on the
restored manager and on the original side by side (``Lockstep``), and their results,
errors and exported states must stay equal.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from staleness import (
    EntryKind,
    StalenessConfig,
    StalenessError,
    StalenessManager,
    StalenessViolation,
)
from tests.staleness.oracle import brute_lexmax_occupied, flow_feasible


class Lockstep:
    """Forwards each call to every manager; they must answer (or fail) identically.

    The first manager is the one the machine restored last; the others are the managers
    it replaced, which saw the same calls without any round trip.
    """

    def __init__(self, managers: list[StalenessManager]) -> None:
        self.managers = managers

    @property
    def version(self) -> int:
        versions = {m.version for m in self.managers}
        assert len(versions) == 1, f"versions diverged after a round trip: {versions}"
        return versions.pop()

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            results = []
            for m in self.managers:
                try:
                    results.append(("ok", getattr(m, name)(*args, **kwargs)))
                except StalenessError as exc:
                    results.append(("error", exc))
            kinds = {(kind, type(r) if kind == "error" else None) for kind, r in results}
            assert len(kinds) == 1, f"{name}{args}: managers diverged: {results}"
            kind, first = results[0]
            if kind == "error":
                assert {str(r) for _, r in results} == {str(first)}
                raise first
            for _, other in results[1:]:
                assert other == first, f"{name}{args}: {other} != {first} after a round trip"
            return first

        return call


class ProtocolMachine(RuleBasedStateMachine):
    @initialize(
        eta=st.integers(0, 3),
        batch=st.integers(1, 4),
        group=st.integers(1, 3),
        batch_red=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
        group_red=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    )
    def setup(self, eta, batch, group, batch_red, group_red):
        cfg = StalenessConfig(eta, batch, group, batch_red, group_red)
        self.m = Lockstep([StalenessManager(cfg)])
        self.cfg = cfg
        self.next_gid = 0
        self.next_tid = 0
        self.members: dict[int, dict[int, int]] = {}  # live group -> traj -> v_traj
        self.done: dict[int, list[int]] = {}
        self.occupied: set[int] = set()
        self.gone: set[int] = set()  # consumed or aborted
        self.consumed: set[int] = set()
        self.stragglers: set[tuple[int, int]] = set()  # (group, traj) settled without it
        self.at_head: set[int] = set()  # groups trainer_groups() showed (a streaming trainer)
        self.filtered = 0  # groups dynamic sampling dropped (filter, or complete's keep)

    # -- operations ---------------------------------------------------------------------

    def _instance_version(self, lag: int) -> int:
        return max(0, self.m.version - lag)

    @rule(lag=st.integers(0, 5))
    def reserve_new_group(self, lag):
        v = self._instance_version(lag)
        ok = self.m.verify(v)
        before = self.m.export_state()
        gid, tid = self.next_gid, self.next_tid
        try:
            self.m.reserve(gid, tid, v)
        except StalenessViolation:
            assert not ok, "verify said yes but reserve refused"
            assert self.m.export_state() == before
            # Exactness: refused only if no placement exists in which occupied groups stay
            # at or before their committed buffers.
            assert not (
                v + self.cfg.eta >= self.m.version
                and flow_feasible(
                    [*self._windows(committed=True), (v, v + self.cfg.eta, False)],
                    self.m.version,
                    self.cfg.eta + 1,
                    self.cfg.batch_size,
                    self.cfg.buffer_capacity,
                )
            )
            return
        assert ok, "verify said no but reserve succeeded"
        self.next_gid += 1
        self.next_tid += 1
        self.members[gid] = {tid: v}
        self.done[gid] = []

    @precondition(lambda self: any(g not in self.occupied for g in self.members))
    @rule(data=st.data(), lag=st.integers(0, 5))
    def reserve_member(self, data, lag):
        open_groups = sorted(g for g in self.members if g not in self.occupied)
        gid = data.draw(st.sampled_from(open_groups))
        v = self._instance_version(lag)
        ok = self.m.verify(v, gid)
        tid = self.next_tid
        try:
            self.m.reserve(gid, tid, v)
        except StalenessViolation:
            assert not ok
            return
        assert ok
        self.next_tid += 1
        self.members[gid][tid] = v

    @precondition(lambda self: any(self._running(g) for g in self.members))
    @rule(data=st.data(), reject=st.booleans())
    def complete(self, data, reject):
        """``reject``: dynamic sampling's keep says no when the group would be occupied."""
        gid = data.draw(st.sampled_from(sorted(g for g in self.members if self._running(g))))
        tid = data.draw(st.sampled_from(sorted(self._running(gid))))
        before = self._occupied_buffers()
        out = self.m.complete(gid, tid, keep=(lambda kept: False) if reject else None)
        if out.filtered:
            assert reject and not out.occupied and not out.abort_groups
            self.done[gid].append(tid)
            assert set(out.kept) == set(self.done[gid]) and len(out.kept) == self.cfg.group_size
            assert set(out.abort_trajectories) == set(self.members[gid]) - set(out.kept)
            self.stragglers.update((gid, t) for t in out.abort_trajectories)
            self._forget(gid)
            self.filtered += 1
            self._moved_only_forward(before)
        elif out.discarded:
            assert gid in out.abort_groups
            self.done[gid].append(tid)
            self._forget(gid)
        else:
            self.done[gid].append(tid)
            if out.occupied:
                assert len(out.kept) == self.cfg.group_size
                assert set(out.kept) == set(self.done[gid])
                assert set(out.abort_trajectories) == set(self.members[gid]) - set(out.kept)
                self.occupied.add(gid)
                for t in out.abort_trajectories:
                    del self.members[gid][t]
                    self.stragglers.add((gid, t))
            else:
                assert len(self.done[gid]) < self.cfg.group_size
        for g in out.abort_groups:
            if g != gid:
                self._forget(g)
        assert out.ready == self.m.is_ready()

    @precondition(lambda self: bool(self.stragglers))
    @rule(data=st.data())
    def straggler_completes(self, data):
        """A member of an aborted group, or a surplus member, finishes late."""
        gid, tid = data.draw(st.sampled_from(sorted(self.stragglers)))
        self.stragglers.discard((gid, tid))
        out = self.m.complete(gid, tid)
        assert out.discarded and out.abort_trajectories == (tid,) and not out.occupied
        assert out.ready == self.m.is_ready()
        assert not self.m.verify(0, gid), "a settled group took a new member"

    @rule(data=st.data())
    def round_trip(self, data):
        """Checkpoint and restore: the restored state equals the saved one field by field,
        and from now on the restored manager must behave exactly like the original."""
        state = self.m.export_state()
        restored = StalenessManager.restore(state)
        assert restored.export_state() == state
        assert restored.view() == self.m.view()
        # keep at most two twins: the newest restore and the manager that never restored
        self.m = Lockstep([restored, self.m.managers[-1]])

    @precondition(lambda self: bool(self.members))
    @rule(data=st.data())
    def abort_group(self, data):
        gid = data.draw(st.sampled_from(sorted(self.members)))
        out = self.m.abort(gid)
        assert set(out.abort_trajectories) == set(self.members[gid])
        assert out.ready == self.m.is_ready()
        self._forget(gid)

    @precondition(lambda self: bool(self.occupied))
    @rule(data=st.data())
    def filter_occupied(self, data):
        """Figure 8c: an occupied group is filtered out; the others only move forward."""
        gid = data.draw(st.sampled_from(sorted(self.occupied)))
        before = self._occupied_buffers()
        out = self.m.filter(gid)
        assert out.filtered and set(out.kept) == set(self.done[gid])
        assert out.ready == self.m.is_ready()
        self._forget(gid)
        self.filtered += 1
        self._moved_only_forward(before)

    @precondition(lambda self: self.m.is_ready())
    @rule()
    def consume(self):
        batch = self.m.consume()
        assert len(batch.groups) == self.cfg.batch_size
        # what a streaming trainer trained early is in the batch (unless aborted outright)
        assert self.at_head - self.gone <= {g.group_id for g in batch.groups}
        self.at_head = set()
        for g in batch.groups:
            assert g.group_id in self.occupied, "consumed a group that was not occupied"
            assert 0 <= batch.version - g.version <= self.cfg.eta
            assert g.version == min(self.members[g.group_id][t] for t in g.trajectories)
            assert set(g.trajectories) == set(self.done[g.group_id])
            assert g.group_id not in self.consumed
            self.consumed.add(g.group_id)
            self._forget(g.group_id)
            # a consumed group is forgotten: its surplus members are dropped by the TS
            self.stragglers = {(gid, t) for gid, t in self.stragglers if gid != g.group_id}
        for gid in batch.aborted_groups:
            assert self.cfg.batch_redundancy > 0
            self._forget(gid)

    # -- helpers ------------------------------------------------------------------------

    def _running(self, gid):
        if gid in self.occupied:
            return []
        return [t for t in self.members[gid] if t not in self.done[gid]]

    def _forget(self, gid):
        if gid in self.members:  # members still running finish late, if ever
            self.stragglers.update((gid, t) for t in self._running(gid))
        self.members.pop(gid, None)
        self.done.pop(gid, None)
        self.occupied.discard(gid)
        self.gone.add(gid)

    def _occupied_buffers(self) -> dict[int, int]:
        return {
            e.group_id: buf.version
            for buf in self.m.view().buffers
            for e in buf.entries
            if e.kind is EntryKind.OCCUPIED
        }

    def _moved_only_forward(self, before: dict[int, int]) -> None:
        after = self._occupied_buffers()
        for gid, buffer in after.items():
            assert gid not in before or buffer <= before[gid], "an occupied group moved later"

    def _windows(self, committed: bool):
        """Each tracked group's admissible buffers; occupied ones capped at their committed
        buffer when ``committed``."""
        buffer_of = {e.group_id: buf.version for buf in self.m.view().buffers for e in buf.entries}
        out = []
        for g in self.members:
            if g in self.occupied:
                v = min(self.members[g][t] for t in self.done[g])
                hi = buffer_of[g] if committed else v + self.cfg.eta
                out.append((v, hi, True))
            else:
                v = min(self.members[g].values())
                out.append((v, v + self.cfg.eta, False))
        return out

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def every_entry_within_bound_and_nothing_lost(self):
        if not hasattr(self, "m"):
            return
        view = self.m.view()
        seen = {}
        for buf in view.buffers:
            assert len(buf.entries) <= self.cfg.buffer_capacity
            assert buf.occupied <= self.cfg.batch_size
            for e in buf.entries:
                assert e.version <= buf.version <= e.version + self.cfg.eta
                assert e.group_id not in seen, "group placed twice"
                seen[e.group_id] = e
        assert set(seen) == set(self.members), "a tracked group was lost or invented"
        assert view.filtered_groups == self.filtered
        for gid, e in seen.items():
            assert (e.kind is EntryKind.OCCUPIED) == (gid in self.occupied)

    @invariant()
    def trainer_groups_are_the_head_and_stay_until_consumed(self):
        if not hasattr(self, "m"):
            return
        head = self.m.trainer_groups()
        ids = {g.group_id for g in head}
        first = self.m.view().buffers[0]
        assert ids == {e.group_id for e in first.entries if e.kind is EntryKind.OCCUPIED}
        for g in head:
            assert set(g.trajectories) == set(self.done[g.group_id])
        assert self.at_head - self.gone <= ids, "a group left the trainer's buffer early"
        self.at_head |= ids

    @invariant()
    def occupied_packed_lexicographically_earliest(self):
        if not hasattr(self, "m") or len(self.members) > 7:
            return
        got = tuple(buf.occupied for buf in self.m.view().buffers)
        best = brute_lexmax_occupied(
            self._windows(committed=False),
            self.m.version,
            self.cfg.eta + 1,
            self.cfg.batch_size,
            self.cfg.buffer_capacity,
        )
        assert got == best


ProtocolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
TestProtocol = ProtocolMachine.TestCase
