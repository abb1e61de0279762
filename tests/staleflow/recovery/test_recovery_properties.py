"""Random interleavings of route / generate / progress / interrupt / finish / reward /
lose an instance / lose a reward worker / late messages / consume / checkpoint-restore,
with the real staleness manager and trajectory server (and the real restore).

After every step: each trajectory ever created is live in the TS, consumed, or aborted,
exactly once; each instance holds exactly what the TS says is routed to it; every group
the manager tracks is in the TS. At every Consume: each group within eta, every token
generated exactly once (an instance generates token ``token(t, p)`` at position ``p``, so
a token lost or repeated by a recovery shows), and every token's version within eta of
the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from staleflow.recovery import Checkpoint
from staleflow.recovery.restore import restore_run
from staleness import StalenessConfig, StalenessManager
from tests.staleflow.recovery.runs import Prompts, response, token
from trajectory_server import (
    Completion,
    FinishedTrajectory,
    NotHolder,
    PartialTrajectory,
    TrajectoryGone,
    TrajectoryServer,
    TrajectoryServerConfig,
    TrajectoryServerError,
)
from trajectory_server.wire import pack_plain, unpack_plain

WORKERS = ("w0", "w1")


@dataclass
class Instance:
    name: str  # a new name for each incarnation, so a dead one's late messages are fenced
    version: int
    held: dict[int, np.ndarray] = field(default_factory=dict)  # traj -> local versions


class RecoveryMachine(RuleBasedStateMachine):
    @initialize(
        eta=st.integers(0, 2),
        batch=st.integers(1, 3),
        group=st.integers(1, 2),
        group_red=st.sampled_from([0.0, 1.0]),
        batch_red=st.sampled_from([0.0, 0.5]),
    )
    def setup(self, eta, batch, group, group_red, batch_red):
        self.protocol = StalenessConfig(eta, batch, group, batch_red, group_red)
        self.ts_config = TrajectoryServerConfig(eta, batch, group, group_red, batch_red)
        self.manager = StalenessManager(self.protocol)
        self.ts = TrajectoryServer(self.ts_config, Prompts())
        self.instances = [Instance(f"{i}.0", 0) for i in range(2)]
        self.incarnations = 0
        self.ghosts: list[tuple[str, int, np.ndarray]] = []  # late messages of dead ones
        self.rewarding: dict[int, tuple[str | None, tuple[np.ndarray, ...]]] = {}
        self.pending: list[int] = []  # in the TS as completed; the Occupy is in flight
        self.group_of: dict[int, int] = {}
        self.consumed: set[int] = set()
        self.aborted: set[int] = set()
        self.steps = 0

    # -- helpers ------------------------------------------------------------------------

    def _forget(self, gone) -> None:
        """Trajectories the TS dropped: instances abort them, workers drop them."""
        for a in gone:
            assert a.traj_id not in self.aborted and a.traj_id not in self.consumed
            self.aborted.add(a.traj_id)
            for inst in self.instances:
                inst.held.pop(a.traj_id, None)
            self.rewarding.pop(a.traj_id, None)

    def _abort(self, traj_ids) -> None:
        live = []
        for t in traj_ids:
            try:
                self.ts.state_of(t)
                live.append(t)
            except TrajectoryGone:
                continue
        self._forget(self.ts.abort(live))

    def _occupy(self, tid: int) -> None:
        """What the control plane does with a reward report."""
        out = self.manager.complete(self.group_of[tid], tid)
        for g in out.abort_groups:
            try:
                self._forget(self.ts.abort_group(g))
            except TrajectoryServerError:
                continue
        self._abort(out.abort_trajectories)

    def _held_by(self) -> dict[int, Instance]:
        return {t: inst for inst in self.instances for t in inst.held}

    # -- rollout ------------------------------------------------------------------------

    @rule(i=st.integers(0, 1), data=st.data())
    def pull(self, i, data):
        inst = self.instances[i]
        inst.version = data.draw(st.integers(inst.version, self.manager.version))

    @rule(i=st.integers(0, 1), data=st.data())
    def route(self, i, data):
        inst = self.instances[i]
        fits = [r for r in self.ts.routing_view() if r.v_traj is None or r.v_traj <= inst.version]
        if not fits:
            return
        chosen = data.draw(st.lists(st.sampled_from(fits), min_size=1, max_size=3, unique=True))
        versions = {}
        for r in chosen:
            if r.v_traj is None:
                if not self.manager.verify(inst.version, r.group_id):
                    continue
                self.manager.reserve(r.group_id, r.traj_id, inst.version)
            versions[r.traj_id] = inst.version if r.v_traj is None else r.v_traj
            self.group_of[r.traj_id] = r.group_id
        for p in self.ts.route(list(versions), versions, inst.name):
            assert p.traj_id not in self._held_by(), "routed to two instances"
            inst.held[p.traj_id] = p.versions

    def _pick_held(self, data):
        held = self._held_by()
        tid = data.draw(st.sampled_from(sorted(held)))
        return tid, held[tid]

    def _grow(self, inst: Instance, tid: int, n: int) -> tuple[np.ndarray, ...]:
        known = inst.held[tid]
        out = response(tid, len(known), n, inst.version, known)
        inst.held[tid] = out[2]
        return out

    @precondition(lambda self: self._held_by())
    @rule(data=st.data(), n=st.integers(1, 3), report=st.booleans())
    def generate(self, data, n, report):
        tid, inst = self._pick_held(data)
        arrays = self._grow(inst, tid, n)
        if report:
            assert self.ts.report_progress([PartialTrajectory(tid, *arrays)], inst.name) == (tid,)

    @precondition(lambda self: self._held_by())
    @rule(data=st.data())
    def interrupt(self, data):
        tid, inst = self._pick_held(data)
        arrays = self._grow(inst, tid, 0)
        self.ts.interrupt_return([PartialTrajectory(tid, *arrays)], instance_id=inst.name)
        del inst.held[tid]

    @precondition(lambda self: self._held_by())
    @rule(
        data=st.data(),
        n=st.integers(0, 2),
        worker=st.sampled_from([None, *WORKERS]),
        report_now=st.booleans(),
    )
    def finish(self, data, n, worker, report_now):
        tid, inst = self._pick_held(data)
        self._finish(tid, inst, n, worker, report_now)

    def _finish(self, tid, inst, n, worker, report_now) -> None:
        """Straight to the TS as completed, or handed to a reward worker first."""
        arrays = self._grow(inst, tid, n)
        del inst.held[tid]
        if worker is None:
            c = Completion(tid, *arrays, 1.0, "stop")
            self.ts.complete_many([c], instance_id=inst.name)
            if report_now:
                self._occupy(tid)
            else:
                self.pending.append(tid)
        else:
            self.ts.hand_to_reward([FinishedTrajectory(tid, *arrays, "stop")], worker)
            self.rewarding[tid] = (worker, arrays)

    @rule(data=st.data())
    def steady_progress(self, data):
        """A healthy stretch of the run: both instances take work at their versions,
        generate, finish and are rewarded; the trainer consumes what is Ready."""
        for i in range(len(self.instances)):
            self.route(i, data)
        for tid, inst in sorted(self._held_by().items()):
            if tid in inst.held and data.draw(st.integers(0, 3)):  # not dropped meanwhile
                self._finish(tid, inst, data.draw(st.integers(1, 3)), None, True)
        while self.manager.is_ready():
            self.consume()

    # -- reward -------------------------------------------------------------------------

    @precondition(lambda self: any(w is not None for w, _ in self.rewarding.values()))
    @rule(data=st.data())
    def reward_done(self, data):
        tid = data.draw(st.sampled_from(sorted(t for t, (w, _) in self.rewarding.items() if w)))
        _, arrays = self.rewarding.pop(tid)
        self.ts.complete(tid, *arrays, 1.0, "stop")
        self.pending.append(tid)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def report_arrives(self, data):
        tid = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self._occupy(tid)

    @precondition(lambda self: self.rewarding)
    @rule(lost=st.sampled_from([None, *WORKERS]), to=st.sampled_from(WORKERS))
    def reward_worker_lost(self, lost, to):
        tasks = self.ts.reassign_rewards(lost, to)
        expected = {t for t, (w, _) in self.rewarding.items() if w == lost}
        assert {t.traj_id for t in tasks} == expected
        for task in tasks:
            _, arrays = self.rewarding[task.traj_id]
            assert task.tokens.tolist() == arrays[0].tolist()
            self.rewarding[task.traj_id] = (to, arrays)

    # -- failures -----------------------------------------------------------------------

    @precondition(lambda self: self._held_by())
    @rule(data=st.data())
    def instance_lost(self, data):
        i = data.draw(st.sampled_from([i for i, x in enumerate(self.instances) if x.held]))
        inst = self.instances[i]
        returned = self.ts.instance_lost(inst.name)
        assert set(returned) == set(inst.held) and len(returned) == len(inst.held)
        self.ghosts.extend((inst.name, t, v) for t, v in inst.held.items())
        self.incarnations += 1
        self.instances[i] = Instance(f"{i}.{self.incarnations}", self.manager.version)

    @precondition(lambda self: self.ghosts)
    @rule(data=st.data())
    def late_message_of_a_dead_instance(self, data):
        name, tid, versions = data.draw(st.sampled_from(self.ghosts))
        before = (tuple(self.ts.routing_view()), self.ts.stats())
        arrays = response(tid, len(versions), 0, 0, versions)
        try:
            self.ts.interrupt_return([PartialTrajectory(tid, *arrays)], instance_id=name)
            raise AssertionError("a dead instance's message was accepted")
        except (NotHolder, TrajectoryGone):
            pass
        assert self.ts.report_progress([PartialTrajectory(tid, *arrays)], name) == ()
        assert (tuple(self.ts.routing_view()), self.ts.stats()) == before

    @precondition(lambda self: self._held_by() or self.pending or self.rewarding)
    @rule(racy=st.booleans())
    def checkpoint_and_restore(self, racy):
        """Stop anywhere and resume: the manager is exported first, then the TS; reports
        still in flight die with the run (and are replayed from the TS)."""
        staleness = unpack_plain(pack_plain(self.manager.export_state()))
        if racy and self._held_by():  # a reward lands in the TS between the two exports
            tid, inst = min(self._held_by().items())
            self.ts.complete_many([Completion(tid, *self._grow(inst, tid, 1), 1.0, "stop")])
            del inst.held[tid]
            self.pending.append(tid)
        trajectories = unpack_plain(pack_plain(self.ts.export_state()))
        ck = Checkpoint(
            self.steps,
            self.manager.version,
            self.manager.version,
            staleness,
            trajectories,
            path=Path("in-memory"),
            protocol=staleness["config"],
        )
        self.manager, self.ts, report = restore_run(
            ck, self.ts_config, Prompts(trajectories["source"]["drawn"])
        )
        assert list(report.replayed) == sorted(t for t in self.pending if t not in self.aborted)
        if not self.pending:  # nothing to replay: restored exactly as saved
            assert self.manager.export_state() == staleness
        self.pending = []
        self.aborted.update(report.aborted)
        for inst in self.instances:  # every actor restarts
            self.ghosts.extend((inst.name, t, v) for t, v in inst.held.items())
        self.incarnations += 1
        self.instances = [Instance(f"{i}.{self.incarnations}", ck.version) for i in range(2)]
        self.rewarding = {
            t: (None, arrays)
            for t, (_, arrays) in self.rewarding.items()
            if t not in report.aborted
        }

    # -- training -----------------------------------------------------------------------

    @precondition(lambda self: self.manager.is_ready())
    @rule()
    def consume(self):
        batch = self.manager.consume()
        eta = self.protocol.eta
        select = {g.group_id: list(g.trajectories) for g in batch.groups}
        taken = self.ts.take_batch(list(select), select)
        for g, group in zip(batch.groups, taken.groups, strict=True):
            assert 0 <= batch.version - g.version <= eta
            for t in group.trajectories:
                assert t.tokens.tolist() == [token(t.traj_id, p) for p in range(len(t.tokens))]
                assert t.v_traj >= g.version and t.v_traj >= batch.version - eta
                if len(t.versions):
                    assert t.versions.min() >= t.v_traj and t.versions.max() <= batch.version
                assert t.traj_id not in self.consumed and t.traj_id not in self.aborted
                self.consumed.add(t.traj_id)
        self._forget(taken.dropped)
        for gid in batch.aborted_groups:
            try:
                self._forget(self.ts.abort_group(gid))
            except TrajectoryServerError:
                continue
        self.steps += 1

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def nothing_lost_or_duplicated(self):
        if not hasattr(self, "ts"):
            return
        live = set(self.ts.export_state()["trajectories"]["id"].tolist())
        created = self.ts.stats().created_trajectories
        assert not (live & self.consumed) and not (live & self.aborted)
        assert not (self.consumed & self.aborted)
        assert live | self.consumed | self.aborted == set(range(created))
        held = [t for inst in self.instances for t in inst.held]
        assert len(held) == len(set(held)), "a trajectory on two instances"
        for inst in self.instances:
            assert set(self.ts.routed_to(inst.name)) == set(inst.held)
        assert self.ts.stats().routed == len(held)
        for g in self.manager.export_state()["groups"]:
            self.ts.group_status(g["id"])  # raises if the TS lost a tracked group


RecoveryMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRecovery = RecoveryMachine.TestCase
