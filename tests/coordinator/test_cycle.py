"""Algorithm 1 (plan_cycle) and the snapshot-command cycle (Coordinator.step)."""

from __future__ import annotations

import itertools
import random

import pytest

from coordinator import (
    Abort,
    Coordinator,
    CoordinatorConfig,
    InProcessExecutor,
    Interrupt,
    Pull,
    Route,
    plan_cycle,
)
from staleness import StalenessConfig, StalenessManager
from tests.coordinator.builders import (
    COST,
    config,
    initial,
    instance,
    manager,
    partial,
    snapshot,
    strategies,
)
from tests.coordinator.fakes import FakeCluster, group

COMBOS = list(itertools.product(("throughput", "vanilla"), repeat=3))


def test_sync_interrupts_pulls_and_reroutes_in_one_cycle() -> None:
    m = manager(3, eta=1, batch=8)
    stale = instance(0, 1, [1_000] * 2, v_traj=1)  # its trajectories have V_traj 1
    snap = snapshot(stale, instance(1, 3, [1_000] * 80))
    # Migration off: emptying instance 0 would otherwise make instance 1 migrate too.
    cmds = plan_cycle(snap, initial(1, 2), 3, m.sketch(), strategies(migration="vanilla"))
    kinds = [type(c) for c in cmds]
    assert kinds[:2] == [Interrupt, Pull]
    assert cmds[0] == Interrupt(0, tuple(t.traj_id for t in stale.run_trajs))
    assert cmds[1] == Pull(0, 3)
    [route] = [c for c in cmds if isinstance(c, Route)]
    assert route.inst == 0
    # The stale partial trajectories come first (MLQ) and keep V_traj 1 (no Reserve).
    assert route.trajs[:2] == cmds[0].trajs
    assert {r.v_traj for r in route.reservations} == {3} and len(route.reservations) == 2


def test_migration_returns_trajectories_that_routing_spreads_out() -> None:
    m = manager(3, eta=1, batch=8)
    fast = instance(0, 3, [1_000] * 30)
    snap = snapshot(fast, instance(1, 3, [20_000]), instance(2, 3))
    cmds = plan_cycle(snap, [], 3, m.sketch(), strategies())
    assert cmds[0] == Interrupt(0, tuple(t.traj_id for t in fast.run_trajs))
    per_inst = {c.inst: len(c.trajs) for c in cmds if isinstance(c, Route)}
    assert sum(per_inst.values()) <= 30 and len(per_inst) >= 2


@pytest.mark.parametrize(("routing", "sync", "migration"), COMBOS)
def test_all_eight_combinations_run(routing: str, sync: str, migration: str) -> None:
    m = manager(3, eta=2, batch=8, group=4)
    snap = snapshot(
        instance(0, 1, [3_000] * 3, v_traj=1),
        instance(1, 2, [1_000] * 40, wait=6),
        instance(2, 3, [500] * 2),
        instance(3, 3),
    )
    strat = strategies(routing=routing, synchronization=sync, migration=migration)
    cmds = plan_cycle(snap, initial(1, 4) + initial(2, 4, 3_000), 3, m.sketch(), strat)
    assert any(isinstance(c, Route) for c in cmds)
    # Instance 1 is behind the PS with 6 > phi_wait queued trajectories that the idle
    # instance 3 could run. Throughput migration releases the excess (case 1); without it,
    # throughput sync Pulls instance 1 to release its queue (coordinator/sync.py).
    release = sync == "throughput" and migration == "vanilla"
    pulls = [c.inst for c in cmds if isinstance(c, Pull)]
    assert bool(pulls) == (sync == "vanilla" or release)
    if release:
        assert pulls == [1]
    assert any(isinstance(c, Interrupt) for c in cmds) == (
        sync == "vanilla" or migration == "throughput" or release
    )


def test_abort_requests_drop_trajectories_from_instances_and_routing() -> None:
    from coordinator.aborts import AbortRequests

    m = manager(3, eta=1, batch=8)
    busy = instance(0, 3, [1_000] * 3)
    doomed = busy.run_trajs[0]
    ts = initial(5, 2) + initial(6, 1)
    aborts = AbortRequests()
    aborts.add(trajs=[doomed.traj_id], groups=[5])
    strat = strategies(migration="vanilla")  # keep instance 0's survivors where they are
    cmds = plan_cycle(snapshot(busy, instance(1, 3)), ts, 3, m.sketch(), strat, aborts)
    assert cmds[0] == Abort(0, (doomed.traj_id,))
    routed = {t for c in cmds if isinstance(c, Route) for t in c.trajs}
    assert routed == {ts[2].traj_id}


class Harness:
    """Coordinator + in-process executor + fake engines/TS/PS + the real manager."""

    def __init__(self, cfg: CoordinatorConfig, versions: dict[int, int], m: StalenessManager):
        self.world = FakeCluster(versions, kv_budget=int(COST.kv_budget))
        self.manager = m
        self.executor = InProcessExecutor(self.world, self.world, self.world, m)
        self.coordinator = Coordinator(
            cfg,
            snapshots=self.world,
            trajectories=self.world,
            parameters=self.world,
            admission=m,
            executor=self.executor,
            instances=versions,
            clock=lambda: 0.0,
        )


def test_step_honours_the_period_and_discards_outdated_snapshots() -> None:
    h = Harness(config(period_s=2.0), {0: 0, 1: 0}, manager(0, eta=1, batch=4, group=2))
    h.world.enqueue(group(1, 2, first_traj=10) + group(2, 2, first_traj=20))
    first = h.coordinator.step(10.0)
    assert first and all(isinstance(c, Route) for c in first)
    # the decision is recorded with the size of what it decided over
    decided = h.coordinator.stats.last_decision
    assert h.coordinator.stats.decisions == 1 and decided is not None
    assert (decided.instances, decided.on_instances, decided.waiting_on_tools) == (2, 0, 0)
    assert decided.routable == 4 and decided.cpu_s >= 0.0
    assert h.coordinator.next_due == 12.0
    assert h.coordinator.step(11.0) == []  # not due
    assert h.coordinator.step(12.0) == []  # due, but the routes have not landed yet
    assert h.coordinator.stats.discarded == 1
    h.executor.run_until_idle()
    h.coordinator.step(14.0)
    assert h.coordinator.stats.discarded == 1 and h.coordinator.stats.cycles == 3
    assert h.coordinator.stats.decisions == 2  # a discarded snapshot decides nothing
    decided = h.coordinator.stats.last_decision
    assert decided is not None and decided.on_instances == 4 and decided.routable == 0
    assert h.coordinator.step() == []  # the injected clock says 0.0: not due
    # a step record's window: the two decisions (not the discarded snapshot), once
    window = h.coordinator.stats.take_recent()
    assert window is not None and window.count == 2
    assert 0.0 <= window.median_ms <= window.max_ms
    assert h.coordinator.stats.take_recent() is None


def test_instances_join_and_leave_between_cycles() -> None:
    """Elastic rollout (and a lost instance's restart): the coordinator routes to a
    newcomer at the next cycle and never again to an instance that left."""
    h = Harness(config(period_s=1.0), {0: 2}, manager(2, eta=1, batch=4, group=2))
    h.world.enqueue(group(1, 2, first_traj=10))
    assert {c.inst for c in h.coordinator.step(0.0)} == {0}
    h.executor.run_until_idle()
    h.world.instances[1] = h.world.instances[0].__class__(2, int(COST.kv_budget))
    h.coordinator.add_instance(1, 2)
    h.world.enqueue(group(2, 2, first_traj=20) + group(3, 2, first_traj=30))
    routed = h.coordinator.step(1.0)
    assert h.coordinator.stats.discarded == 0 and 1 in {c.inst for c in routed}
    h.executor.run_until_idle()
    del h.world.instances[0]  # instance 0 is gone: its snapshot no longer comes
    h.coordinator.remove_instance(0)
    h.world.enqueue(group(4, 2, first_traj=40))
    again = h.coordinator.step(2.0)
    assert h.coordinator.stats.discarded == 0
    assert again and {c.inst for c in again} == {1}
    with pytest.raises(ValueError, match="not tracked"):
        h.coordinator.remove_instance(0)


@pytest.mark.parametrize("race", [False, True], ids=["settled", "racing"])
@pytest.mark.parametrize(("routing", "sync", "migration"), COMBOS)
def test_closed_loop_conserves_trajectories_and_respects_eta(
    routing: str, sync: str, migration: str, race: bool
) -> None:
    """A small cluster over 200 cycles. ``racing``: trajectories finish between the
    snapshot and the commands, so Interrupts miss them and the executor must report it,
    or the speculative state would reject every later snapshot."""
    rng = random.Random(f"{routing}{sync}{migration}{race}")
    eta, batch, G = 1, 3, 2
    m = StalenessManager(StalenessConfig(eta=eta, batch_size=batch, group_size=G))
    h = Harness(
        config(routing=routing, synchronization=sync, migration=migration, period_s=1.0),
        {i: 0 for i in range(4)},
        m,
    )
    world, ids = h.world, itertools.count()
    all_trajs: set[int] = set()
    trained = 0

    def finish_some() -> None:
        for inst in world.instances.values():  # reward is instant
            for tid, t in list(inst.running.items()):
                if rng.random() < 0.3:
                    world.finish(tid)
                    m.complete(t.group_id, tid)

    for now in range(200):
        while len(world.ts) < 3 * G:  # the TS keeps itself topped up
            first = next(ids) * G
            world.enqueue(group(first // G, G, first_traj=first, length=rng.choice([50, 500])))
            all_trajs.update(range(first, first + G))
        h.coordinator.step(float(now))
        if race:
            finish_some()
        h.executor.run_until_idle()
        world.generate(50)
        if not race:
            finish_some()
        while m.is_ready():
            consumed = m.consume()
            trained += 1
            assert all(consumed.version - g.version <= eta for g in consumed.groups)
            world.ps_version = consumed.version + 1  # the trainer pushes the next version
        for tid in all_trajs:
            assert len(world.where(tid)) == 1, (tid, world.where(tid))
    assert trained >= 5
    assert h.coordinator.stats.discarded == 0  # every shortfall was settled in time


@pytest.mark.parametrize("factor", [1.0, 3.0, 5.0])
def test_a_fleet_uniformly_slower_than_its_model_still_routes(factor: float) -> None:
    """Speed ranks instances against each other: a fleet whose every instance is measured
    ``factor`` times slower than the profiled model (a loaded machine, a pessimistic
    profile) routes as the model would. It once withheld everything (each gain over the
    factor fell below mu x the model's ideal gain), and idle instances measure nothing
    new: the run stalled for good."""
    m = manager(1, eta=1, batch=2)
    strat = strategies(estimation=True)
    assert strat.estimator is not None
    for inst in (0, 1):
        strat.estimator.set_factor(inst, factor)
    snap = snapshot(instance(0, 1), instance(1, 1))
    cmds = plan_cycle(snap, [partial(1, group_id=1), *initial(2)], 1, m.sketch(), strat)
    routed = [t for c in cmds if isinstance(c, Route) for t in c.trajs]
    assert len(routed) == 2, cmds
