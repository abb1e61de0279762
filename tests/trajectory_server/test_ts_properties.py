"""Property test: random interleavings of every TS call against a plain model.

After each step: every trajectory id ever created is live in exactly one state (as the
model says) or was consumed, aborted or filtered exactly once; the routing view is the model's MLQ
(smaller V_traj first, initial last, FIFO within a level); the counters agree.
Invalid calls must raise and change nothing. The recovery calls (progress reports, a lost
instance, a lost reward worker) and a checkpoint round trip may happen at any point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trajectory_server import (
    FinishedTrajectory,
    InvalidPayload,
    InvalidTransition,
    NotHolder,
    PartialTrajectory,
    TrajectoryGone,
    TrajectoryServer,
    TrajectoryServerConfig,
    TrajectoryServerError,
    TrajState,
    VersionConflict,
)
from trajectory_server.wire import pack_plain, unpack_plain

Q, R, W, C = TrajState.QUEUED, TrajState.ROUTED, TrajState.REWARDING, TrajState.COMPLETED
INSTANCES, WORKERS = (0, 1, 2), ("w0", "w1")


@dataclass(frozen=True)
class _Sample:
    sample_id: int
    prompt_ids: np.ndarray
    answer: str


class _Source:
    def __init__(self) -> None:
        self.n = 0

    def next_sample(self) -> _Sample:
        self.n += 1
        return _Sample(self.n, np.full(1 + self.n % 4, 7, dtype=np.int32), "a")


@dataclass
class _Traj:
    group: int
    prompt_len: int
    state: TrajState = Q
    v: int | None = None
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    holder: int | str | None = None  # instance (ROUTED) or reward worker (REWARDING)


class TrajectoryServerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = TrajectoryServerConfig(eta=1, batch_size=2, group_size=2, group_redundancy=0.5)
        self.source = _Source()
        self.ts = TrajectoryServer(config, self.source)
        self.live: dict[int, _Traj] = {}
        self.fifo: dict[int | None, list[int]] = {None: []}
        self.consumed: set[int] = set()
        self.aborted: set[int] = set()
        self.filtered: set[int] = set()  # dynamic sampling's drops (filter_group)
        self.known = 0
        self.incarnation = dict.fromkeys(INSTANCES, 0)  # a lost instance restarts as i.k+1
        self.lost: list[str] = []
        self.absorb_new()

    def holder(self, instance: int) -> str:
        return f"{instance}.{self.incarnation[instance]}"

    # ------------------------------------------------------------ model help

    def absorb_new(self) -> None:
        """New trajectories appear only as initial ones at the back of the view."""
        created = self.ts.stats().created_trajectories
        by_id = {r.traj_id: r for r in self.ts.routing_view()}
        for tid in range(self.known, created):
            rec = by_id[tid]
            self.live[tid] = _Traj(rec.group_id, rec.prompt_len)
            self.fifo[None].append(tid)
        self.known = created

    def ids_in(self, *states: TrajState) -> list[int]:
        return sorted(t for t, m in self.live.items() if m.state in states)

    def leave(self, tid: int, into: set[int]) -> None:
        m = self.live.pop(tid)
        ended = self.consumed | self.aborted | self.filtered
        assert tid not in ended, f"{tid} ended twice"
        into.add(tid)
        if m.state is Q:
            self.fifo[m.v].remove(tid)

    def grow(self, data: st.DataObject, tid: int) -> tuple[np.ndarray, ...]:
        m = self.live[tid]
        extra = data.draw(st.integers(0, 3))
        new_tokens = m.tokens + data.draw(
            st.lists(st.integers(0, 500), min_size=extra, max_size=extra)
        )
        newer = data.draw(st.lists(st.integers(0, 2), min_size=extra, max_size=extra))
        assert m.v is not None
        new_versions = m.versions + [m.v + d for d in newer]
        return (
            np.array(new_tokens, dtype=np.int32),
            np.full(len(new_tokens), -1.0, dtype=np.float32),
            np.array(new_versions, dtype=np.int32),
        )

    def expect_unchanged(self, call, error: type[Exception]) -> None:
        before = (tuple(self.ts.routing_view()), self.ts.stats())
        with pytest.raises(error):
            call()
        assert (tuple(self.ts.routing_view()), self.ts.stats()) == before

    # ----------------------------------------------------------------- rules

    @rule()
    def refill(self) -> None:
        assert self.ts.refill() == ()  # auto refill keeps it full
        self.absorb_new()

    @precondition(lambda self: self.ids_in(Q))
    @rule(data=st.data())
    def route(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.ids_in(Q)), min_size=1, unique=True))
        versions = {}
        for tid in chosen:
            v = self.live[tid].v
            versions[tid] = data.draw(st.integers(0, 3)) if v is None else v
        instance = self.holder(data.draw(st.sampled_from(INSTANCES)))
        payloads = self.ts.route(chosen, versions, instance_id=instance)
        assert [p.traj_id for p in payloads] == chosen
        for p in payloads:
            m = self.live[p.traj_id]
            assert p.v_traj == versions[p.traj_id] and p.tokens.tolist() == m.tokens
            assert p.group_id == m.group and len(p.prompt) == m.prompt_len
            self.fifo[m.v].remove(p.traj_id)
            m.state, m.v, m.holder = R, p.v_traj, instance
            self.fifo.setdefault(m.v, [])

    @precondition(lambda self: self.ids_in(R))
    @rule(data=st.data())
    def interrupt(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.ids_in(R)), min_size=1, unique=True))
        partials = [PartialTrajectory(tid, *self.grow(data, tid)) for tid in chosen]
        self.ts.interrupt_return(partials)
        for p in partials:
            m = self.live[p.traj_id]
            m.state, m.tokens, m.versions = Q, p.tokens.tolist(), p.versions.tolist()
            m.holder = None
            self.fifo[m.v].append(p.traj_id)

    @precondition(lambda self: self.ids_in(R, W))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.ids_in(R, W)))
        m = self.live[tid]
        if m.state is R:
            tokens, logprobs, versions = self.grow(data, tid)
        else:  # REWARDING: the finished response, as stored
            tokens, versions = np.array(m.tokens, np.int32), np.array(m.versions, np.int32)
            logprobs = np.full(len(m.tokens), -1.0, dtype=np.float32)
        status = self.ts.complete(tid, tokens, logprobs, versions, 1.0, "stop")
        m.state, m.tokens, m.versions = C, tokens.tolist(), versions.tolist()
        m.holder = None
        members = [t for t, x in self.live.items() if x.group == m.group]
        assert status.live == len(members)
        assert status.completed == sum(self.live[t].state is C for t in members)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        states = {tid: self.live[tid].state for tid in chosen}
        out = self.ts.abort(chosen)
        assert [(a.traj_id, a.state) for a in out] == [(t, states[t]) for t in chosen]
        for tid in chosen:
            self.leave(tid, self.aborted)
        self.absorb_new()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_group(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(sorted({m.group for m in self.live.values()})))
        out = self.ts.abort_group(gid)
        expected = sorted(t for t, m in self.live.items() if m.group == gid)
        assert sorted(a.traj_id for a in out) == expected
        for tid in expected:
            self.leave(tid, self.aborted)
        self.absorb_new()

    def completed_groups(self) -> list[int]:
        """Groups whose live members are all COMPLETED (what dynamic sampling filters)."""
        groups = {m.group for m in self.live.values()}
        return sorted(
            g for g in groups if all(m.state is C for m in self.live.values() if m.group == g)
        )

    @precondition(lambda self: self.completed_groups())
    @rule(data=st.data())
    def filter_group(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self.completed_groups()))
        ledger = {t.traj_id: t for t in self.ts.ledger()}
        expected = sorted(t for t, m in self.live.items() if m.group == gid)
        assert all(ledger[t].reward == 1.0 for t in expected)  # graded: the ledger has it
        out = self.ts.filter_group(gid)
        assert sorted(a.traj_id for a in out) == expected
        assert all(a.state is C and a.instance_id is None for a in out)
        for tid in expected:
            self.leave(tid, self.filtered)
        self.absorb_new()

    @precondition(lambda self: self.ids_in(C))
    @rule(data=st.data())
    def take_batch(self, data: st.DataObject) -> None:
        ready = sorted({self.live[t].group for t in self.ids_in(C)})
        gids = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        select = {}
        for gid in gids:
            done = [t for t in self.ids_in(C) if self.live[t].group == gid]
            if data.draw(st.booleans()):
                select[gid] = data.draw(st.lists(st.sampled_from(done), min_size=1, unique=True))
        batch = self.ts.take_batch(gids, select or None)
        assert [g.group_id for g in batch.groups] == gids
        taken: set[int] = set()
        for g in batch.groups:
            done = [t for t in self.ids_in(C) if self.live[t].group == g.group_id]
            want = select.get(g.group_id, done)
            assert [t.traj_id for t in g.trajectories] == want
            for t in g.trajectories:
                m = self.live[t.traj_id]
                assert t.tokens.tolist() == m.tokens and t.versions.tolist() == m.versions
                assert t.v_traj == m.v and min(m.versions, default=m.v) >= m.v
            taken.update(want)
        members = {t for t, m in self.live.items() if m.group in gids}
        assert {d.traj_id for d in batch.dropped} == members - taken
        for tid in taken:
            self.leave(tid, self.consumed)
        for tid in members - taken:
            self.leave(tid, self.aborted)
        self.absorb_new()

    # --------------------------------------------------------------- recovery

    @precondition(lambda self: self.ids_in(R))
    @rule(data=st.data())
    def report_progress(self, data: st.DataObject) -> None:
        """The reporter's own trajectories grow; reports from another instance and about
        trajectories it does not hold are ignored."""
        holders = [self.holder(i) for i in INSTANCES] + self.lost
        reporter = data.draw(st.sampled_from(holders))
        chosen = data.draw(st.lists(st.sampled_from(self.ids_in(R)), min_size=1, unique=True))
        partials = [PartialTrajectory(tid, *self.grow(data, tid)) for tid in chosen]
        recorded = self.ts.report_progress(partials, reporter)
        expected = [
            p.traj_id
            for p in partials
            if self.live[p.traj_id].holder == reporter
            and len(p.tokens) > len(self.live[p.traj_id].tokens)
        ]
        assert list(recorded) == expected
        for p in partials:
            if p.traj_id in expected:
                m = self.live[p.traj_id]
                m.tokens, m.versions = p.tokens.tolist(), p.versions.tolist()

    @rule(index=st.sampled_from(INSTANCES))
    def instance_lost(self, index: int) -> None:
        instance = self.holder(index)
        held = {t for t in self.ids_in(R) if self.live[t].holder == instance}
        returned = self.ts.instance_lost(instance)
        assert set(returned) == held and len(returned) == len(held)
        self.lost.append(instance)
        self.incarnation[index] += 1
        for tid in returned:  # the longest known response, V_traj kept, back of its level
            m = self.live[tid]
            m.state, m.holder = Q, None
            self.fifo[m.v].append(tid)

    @precondition(lambda self: self.ids_in(R))
    @rule(data=st.data(), worker=st.sampled_from(WORKERS))
    def hand_to_reward(self, data: st.DataObject, worker: str) -> None:
        tid = data.draw(st.sampled_from(self.ids_in(R)))
        finished = FinishedTrajectory(tid, *self.grow(data, tid), "stop")
        self.ts.hand_to_reward([finished], worker)
        m = self.live[tid]
        m.state, m.holder = W, worker
        m.tokens, m.versions = finished.tokens.tolist(), finished.versions.tolist()

    @rule(lost=st.sampled_from([*WORKERS, None]), to=st.sampled_from([*WORKERS, None]))
    def reassign_rewards(self, lost: str | None, to: str | None) -> None:
        held = {t for t in self.ids_in(W) if self.live[t].holder == lost}
        tasks = self.ts.reassign_rewards(lost, to)
        assert {t.traj_id for t in tasks} == held and len(tasks) == len(held)
        for task in tasks:
            m = self.live[task.traj_id]
            assert task.tokens.tolist() == m.tokens and task.v_traj == m.v
            m.holder = to

    @rule()
    def checkpoint_round_trip(self) -> None:
        """Export, pack as a checkpoint file would, restore: ROUTED ones are QUEUED again
        (at the back of their level, in id order), reward workers are forgotten."""
        state = unpack_plain(pack_plain(self.ts.export_state()))
        self.ts = TrajectoryServer.restore(self.ts.config, self.source, state)
        for tid in self.ids_in(R):
            m = self.live[tid]
            m.state, m.holder = Q, None
            self.fifo[m.v].append(tid)
        for tid in self.ids_in(W):
            self.live[tid].holder = None

    # --------------------------------------------------------- invalid calls

    @precondition(lambda self: self.lost and self.ids_in(Q))
    @rule(data=st.data())
    def route_to_lost(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.ids_in(Q)))
        lost = data.draw(st.sampled_from(self.lost))
        v = self.live[tid].v
        self.expect_unchanged(lambda: self.ts.route([tid], 0 if v is None else v, lost), NotHolder)

    @precondition(lambda self: self.ids_in(R, C))
    @rule(data=st.data())
    def route_not_queued(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.ids_in(R, C)))
        self.expect_unchanged(lambda: self.ts.route([tid], 0, 0), InvalidTransition)

    @precondition(lambda self: any(self.live[t].v is not None for t in self.ids_in(Q)))
    @rule(data=st.data())
    def route_changing_version(self, data: st.DataObject) -> None:
        partial = [t for t in self.ids_in(Q) if self.live[t].v is not None]
        tid = data.draw(st.sampled_from(partial))
        v = self.live[tid].v + data.draw(st.sampled_from([-1, 1]))  # type: ignore[operator]
        self.expect_unchanged(lambda: self.ts.route([tid], v, 0), VersionConflict)

    @precondition(lambda self: self.ids_in(Q, C))
    @rule(data=st.data())
    def complete_or_interrupt_not_routed(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.ids_in(Q, C)))
        empty = (np.empty(0, np.int32), np.empty(0, np.float32), np.empty(0, np.int32))
        self.expect_unchanged(lambda: self.ts.complete(tid, *empty, 0.0, "stop"), InvalidTransition)
        self.expect_unchanged(
            lambda: self.ts.interrupt_return([PartialTrajectory(tid, *empty)]), InvalidTransition
        )

    @precondition(lambda self: self.ids_in(R))
    @rule(data=st.data())
    def complete_batch_with_one_bad(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.ids_in(R)))
        tokens, logprobs, versions = self.grow(data, tid)
        bad = (tokens, logprobs[:-1] if len(logprobs) else np.ones(1, np.float32), versions)
        self.expect_unchanged(
            lambda: self.ts.interrupt_return([PartialTrajectory(tid, *bad)]), InvalidPayload
        )

    @precondition(lambda self: self.consumed | self.aborted | self.filtered)
    @rule(data=st.data())
    def touch_gone(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.consumed | self.aborted | self.filtered)))
        self.expect_unchanged(lambda: self.ts.abort([tid]), TrajectoryGone)
        self.expect_unchanged(lambda: self.ts.route([tid], 0, 0), TrajectoryGone)

    # ------------------------------------------------------------ invariants

    @invariant()
    def every_id_accounted_once(self) -> None:
        created = self.ts.stats().created_trajectories
        assert created == self.known
        ended = (self.consumed, self.aborted, self.filtered)
        assert (
            not self.consumed & self.aborted and not (self.consumed | self.aborted) & self.filtered
        )
        assert set(self.live).union(*ended) == set(range(created))
        assert len(self.live) + sum(map(len, ended)) == created
        for tid, m in self.live.items():
            assert self.ts.state_of(tid) is m.state
        for instance in [self.holder(i) for i in INSTANCES] + self.lost:
            held = [t for t in self.ids_in(R) if self.live[t].holder == instance]
            assert sorted(self.ts.routed_to(instance)) == held
        ledger = self.ts.ledger()
        assert [e.traj_id for e in ledger] == sorted(self.live)
        for e in ledger:
            m = self.live[e.traj_id]
            assert (e.group_id, e.state, e.v_traj, e.tokens) == (
                m.group,
                m.state,
                m.v,
                len(m.tokens),
            )
            assert e.holder == m.holder
            assert e.reward == (1.0 if m.state is C else None)  # every completion gets 1.0

    @invariant()
    def view_is_the_mlq(self) -> None:
        levels = sorted(v for v in self.fifo if v is not None)
        expected = [t for v in [*levels, None] for t in self.fifo[v]]
        view = self.ts.routing_view()
        assert [r.traj_id for r in view] == expected
        for r in view:
            m = self.live[r.traj_id]
            assert (r.group_id, r.v_traj, r.prompt_len) == (m.group, m.v, m.prompt_len)
            assert r.length == m.prompt_len + len(m.tokens)

    @invariant()
    def counters_agree(self) -> None:
        s = self.ts.stats()
        got = (s.queued, s.routed, s.rewarding, s.completed)
        assert got == tuple(len(self.ids_in(x)) for x in (Q, R, W, C))
        assert s.initial == len(self.fifo[None])
        assert (s.consumed_trajectories, s.aborted_trajectories, s.filtered_trajectories) == (
            len(self.consumed),
            len(self.aborted),
            len(self.filtered),
        )
        assert s.created_trajectories == (
            len(self.live) + len(self.consumed) + len(self.aborted) + len(self.filtered)
        )
        assert s.groups == s.capacity_groups == len({m.group for m in self.live.values()})
        for state, by_v in ((Q, s.queued_by_v), (R, s.routed_by_v), (C, s.completed_by_v)):
            counts: dict[int, int] = {}
            for m in self.live.values():
                if m.state is state and m.v is not None:
                    counts[m.v] = counts.get(m.v, 0) + 1
            assert by_v == counts


TrajectoryServerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_trajectory_server_state_machine = TrajectoryServerMachine.TestCase


def test_errors_share_a_base_class():
    assert issubclass(VersionConflict, TrajectoryServerError)
    assert issubclass(TrajectoryGone, TrajectoryServerError)
