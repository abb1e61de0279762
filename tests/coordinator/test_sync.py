"""Algorithm 4 and greedy synchronisation."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import TrajectoryView
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.routing import ThroughputRouting
from coordinator.sync import GreedySync, ThroughputSync
from staleness import StalenessManager
from staleness.interface import AdmissionSketch
from tests.coordinator.builders import (
    COST,
    initial,
    instance,
    manager,
    partial,
    snapshot,
    strategies,
)
from tests.coordinator.test_routing import HEAVY, MODERATE

ROUTING = ThroughputRouting(COST, 0.3)


def sync(
    fleet: Fleet,
    ts: Sequence[TrajectoryView],
    ps: int,
    sketch: AdmissionSketch,
    phi_wait: int | None = None,
) -> list[int]:
    strategy = ThroughputSync(ROUTING, phi_wait)
    return [fleet.ids[p] for p in strategy.select(fleet, TrajectoryPool(ts), ps, sketch)]


def test_syncs_an_instance_that_cannot_take_work_until_it_pulls() -> None:
    m = manager(3, eta=1)  # V_traj 1 is too stale for any buffer left
    fleet = Fleet(snapshot(instance(0, 1), instance(1, 3, HEAVY)))
    assert sync(fleet, initial(1, 4), 3, m.sketch()) == [0]


def test_no_sync_while_work_is_routable_at_the_current_version() -> None:
    m = manager(3, eta=1)
    fleet = Fleet(snapshot(instance(0, 2), instance(1, 3)))
    assert sync(fleet, initial(1, 4), 3, m.sketch()) == []
    # A partial trajectory of version 2 is routable to it too.
    assert sync(fleet, [partial(2)], 3, m.sketch()) == []


def test_no_sync_when_the_upgrade_would_not_attract_a_route() -> None:
    m = manager(3, eta=1)
    # Instance 0 is busy: even at version 3 its gain stays under the threshold.
    fleet = Fleet(snapshot(instance(0, 1, HEAVY, v_traj=1), instance(1, 3, MODERATE)))
    assert sync(fleet, initial(1, 1), 3, m.sketch()) == []
    # Nothing in the TS at all: nothing to unlock.
    assert sync(Fleet(snapshot(instance(0, 1))), [], 3, m.sketch()) == []


def test_no_sync_when_an_up_to_date_instance_wins_every_decision() -> None:
    m = manager(3, eta=1)
    fleet = Fleet(snapshot(instance(0, 1, MODERATE, v_traj=1), instance(1, 3)))
    # One trajectory: the idle, current instance 1 takes it.
    assert sync(fleet, initial(1, 1), 3, m.sketch()) == []
    # Many: instance 1 fills up and instance 0, once upgraded, would win some.
    assert sync(fleet, initial(1, 40), 3, manager(3, eta=1, batch=64).sketch()) == [0]


def test_tentative_routing_leaves_fleet_and_sketch_untouched() -> None:
    m = manager(3, eta=1)
    fleet = Fleet(snapshot(instance(0, 1), instance(1, 3)))
    sketch = m.sketch()
    assert sync(fleet, initial(1, 3), 3, sketch) == [0]
    assert fleet.n_run.tolist() == [0, 0] and fleet.version.tolist() == [1, 3]
    assert m.view().reserved_groups == 0
    # The sketch passed in still admits what it admitted before.
    assert sketch.verify(3, 1)


def test_greedy_syncs_every_lagging_instance() -> None:
    fleet = Fleet(snapshot(instance(0, 1, MODERATE), instance(1, 3), instance(2, 2)))
    got = GreedySync().select(fleet, TrajectoryPool([]), 3, manager(3).sketch())
    assert [fleet.ids[p] for p in got] == [0, 2]


# -- the single tentative pass answers exactly what Algorithm 4 asks -----------------------


def brute_force_algorithm4(
    fleet: Fleet,
    ts: list[TrajectoryView],
    ps: int,
    m: StalenessManager,
    routing: ThroughputRouting = ROUTING,
) -> list[int]:
    """Algorithm 4 as written: one full tentative routing per candidate. With fresh
    admission (``routing.fresh``) an initial trajectory is no reason to keep a version,
    and every routing pass starts new trajectories at the PS's version only."""
    levels = TrajectoryPool(ts).ts_levels()
    out = []
    for pos in range(len(fleet)):
        v = int(fleet.version[pos])
        if v >= ps:
            continue
        sketch = m.sketch()
        if any(
            (t.v_traj is None and not routing.fresh and sketch.verify(v, t.group_id))
            or (t.v_traj is not None and v >= t.v_traj)
            for t in ts
        ):
            continue
        tentative = fleet.copy()
        tentative.set_version(pos, ps)
        routed = routing.run(tentative, levels, m.sketch(), fresh_from=routing.fresh_from(ps))
        if any(p.pos == pos for p in routed):
            out.append(fleet.ids[pos])
    return out


@st.composite
def scenarios(
    draw: st.DrawFn, group: int = 1
) -> tuple[Fleet, list[TrajectoryView], int, StalenessManager]:
    """A fleet, the TS, the PS's version and the manager; the TS's new groups have
    ``group`` members (groups in flight are tracked with one)."""
    ps = draw(st.integers(2, 5))
    eta = draw(st.integers(0, 2))
    m = manager(ps, eta=eta, batch=draw(st.integers(1, 4)), group=group)
    for g in range(draw(st.integers(0, 6))):  # groups already in flight
        v = draw(st.integers(max(0, ps - eta), ps))
        if m.verify(v):
            m.reserve(10_000 + g, 10_000 + g, v)
    insts = []
    for i in range(draw(st.integers(1, 5))):
        v = draw(st.integers(max(0, ps - 3), ps))
        n = draw(st.integers(0, 60))
        insts.append(instance(i, v, [draw(st.sampled_from([200, 1_000, 1_500]))] * n))
    ts: list[TrajectoryView] = []
    for g in range(draw(st.integers(0, 6))):
        ts += initial(g, group, draw(st.sampled_from([100, 2_000])))
    for _ in range(draw(st.integers(0, 3))):
        ts.append(partial(draw(st.integers(max(0, ps - 3), ps)), 500))
    return Fleet(snapshot(*insts)), ts, ps, m


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_single_pass_equals_algorithm4(
    case: tuple[Fleet, list[TrajectoryView], int, StalenessManager],
) -> None:
    fleet, ts, ps, m = case
    assert sync(fleet, ts, ps, m.sketch()) == brute_force_algorithm4(fleet, ts, ps, m)


# -- a queue piled on a lagging instance is released by its Pull -------------------------


def test_syncs_a_lagging_instance_whose_queue_another_instance_could_run() -> None:
    # Vanilla routing has no threshold: it can queue far more trajectories on the only
    # instance of a version than that instance runs. Once the PS moves on and the TS has
    # nothing for that instance, Algorithm 4 alone never Pulls it (a queued instance wins
    # no tentative decision) and, without migration, its queue waits for it alone.
    m = manager(2, eta=3, batch=64)
    fleet = Fleet(snapshot(instance(0, 1, MODERATE, wait=40), instance(1, 2)))
    assert sync(fleet, [], 2, m.sketch()) == []  # Algorithm 4 alone
    assert sync(fleet, [], 2, m.sketch(), phi_wait=3) == [0]


def test_a_queue_within_phi_wait_is_left_to_the_instance() -> None:
    m = manager(2, eta=3, batch=64)
    fleet = Fleet(snapshot(instance(0, 1, MODERATE, wait=3), instance(1, 2)))
    assert sync(fleet, [], 2, m.sketch(), phi_wait=3) == []


def test_a_queue_no_other_instance_can_take_stays() -> None:
    m = manager(2, eta=3, batch=64)
    # The only other instance is older than the queued trajectories' V_traj ...
    fleet = Fleet(snapshot(instance(0, 1, MODERATE, wait=40), instance(1, 0)))
    assert sync(fleet, [], 2, m.sketch(), phi_wait=3) == []
    # ... or too busy for any of them to clear the routing threshold.
    fleet = Fleet(snapshot(instance(0, 1, MODERATE, wait=40), instance(1, 2, HEAVY)))
    assert sync(fleet, [], 2, m.sketch(), phi_wait=3) == []
    # Not behind the PS: a Pull would load nothing new (only migration may move them).
    fleet = Fleet(snapshot(instance(0, 2, MODERATE, wait=40), instance(1, 2)))
    assert sync(fleet, [], 2, m.sketch(), phi_wait=3) == []


def test_an_instance_synced_this_cycle_can_take_the_queue() -> None:
    # Instance 1 is behind too and Algorithm 4 Pulls it (it is idle and the TS holds work
    # for version 2 only); after that Pull it can run instance 0's queue (Algorithm 1
    # applies the Pulls before routing), so instance 0 is released in the same cycle.
    m = manager(2, eta=1, batch=64)
    fleet = Fleet(snapshot(instance(0, 1, MODERATE, wait=40), instance(1, 0)))
    assert sync(fleet, initial(1, 2), 2, m.sketch(), phi_wait=3) == [0, 1]


def test_queue_release_is_on_only_without_proactive_migration() -> None:
    # Throughput migration (case 1) returns the same queue to the TS without interrupting
    # the running trajectories, so Algorithm 4 then stays as the paper writes it.
    released = strategies(routing="vanilla", migration="vanilla", phi_wait=5).sync
    assert isinstance(released, ThroughputSync) and released.phi_wait == 5
    paper = strategies(routing="vanilla", migration="throughput").sync
    assert isinstance(paper, ThroughputSync) and paper.phi_wait is None
