"""Algorithm 3 (with Algorithm 2) on hand-built snapshots with known answers.

Loads used below, with Table 4's coefficients and trajectories of 100 tokens
(threshold mu * ΔT_ideal = 0.3 * 80.5 ≈ 24 tok/s):
- idle:     gain 80.5 (the ideal)
- moderate: 10 running, 10K KV tokens -> gain ≈ 75.6 (clears the threshold)
- heavy:    80 running, 80K KV tokens -> gain ≈ 22.6 (does not)
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import Snapshot, TrajectoryView
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.routing import ThroughputRouting
from staleness import StalenessManager
from staleness.interface import AdmissionSketch
from tests.coordinator.builders import COST, initial, instance, manager, partial, snapshot

MODERATE = [1_000] * 10
HEAVY = [1_000] * 80


def route(
    snap: Snapshot, ts: list[TrajectoryView], sketch: AdmissionSketch, mu: float = 0.3
) -> list[tuple[int, int, int]]:
    """(instance id, traj id, V_traj) per decision, in decision order."""
    fleet = Fleet(snap)
    placements = ThroughputRouting(COST, mu).route(fleet, TrajectoryPool(ts), sketch)
    return [(fleet.ids[p.pos], p.traj.traj_id, p.v_traj) for p in placements]


def test_load_levels_match_the_docstring() -> None:
    thr = 0.3 * COST.ideal_gain(100)
    assert COST.marginal_gain(0, 0, 0, 100) > COST.marginal_gain(10, 10_000, 0, 100) > thr
    assert COST.marginal_gain(80, 80_000, 0, 100) < thr


def test_full_kv_cache_never_receives_a_route() -> None:
    full = instance(0, 3, [49_960, 49_960])  # 99,920 of 100,000 tokens
    snap = snapshot(full, instance(1, 3, MODERATE))
    routes = route(snap, initial(1, 5), manager(3, batch=8).sketch())
    assert routes and {inst for inst, _, _ in routes} == {1}
    # Alone, the full instance gets nothing and the trajectories are withheld.
    assert route(snapshot(full), initial(2, 3), manager(3, batch=8).sketch()) == []


def test_instance_with_a_waiting_queue_never_receives_a_route() -> None:
    snap = snapshot(instance(0, 3, [100], wait=1), instance(1, 3, HEAVY))
    assert route(snap, initial(1, 2), manager(3).sketch()) == []


def test_initial_trajectory_goes_only_where_verify_admits_it() -> None:
    m = manager(3, eta=1)  # admissible V_traj: 2 and 3
    assert not m.verify(1)
    snap = snapshot(instance(0, 1), instance(1, 3, MODERATE))
    [(inst, _, v)] = route(snap, initial(1), m.sketch())
    assert (inst, v) == (1, 3)
    # Only the inadmissible instance clears the threshold: withheld.
    snap = snapshot(instance(0, 1), instance(1, 3, HEAVY))
    assert route(snap, initial(1), m.sketch()) == []


def test_partial_trajectory_never_goes_to_an_older_instance() -> None:
    m = manager(3, eta=2)
    t = partial(v_traj=2)
    snap = snapshot(instance(0, 1), instance(1, 2, MODERATE), instance(2, 3, HEAVY))
    assert route(snap, [t], m.sketch()) == [(1, t.traj_id, 2)]
    snap = snapshot(instance(0, 1), instance(1, 2, HEAVY), instance(2, 3, HEAVY))
    assert route(snap, [t], m.sketch()) == []  # withheld, not sent to version 1


def test_waterfall_prefers_the_lower_version_group_when_it_clears() -> None:
    m = manager(3, eta=1)
    snap = snapshot(instance(0, 2, MODERATE), instance(1, 3))
    [(inst, _, v)] = route(snap, initial(1), m.sketch())
    assert (inst, v) == (0, 2)  # although the idle instance 1 would gain more


def test_waterfall_falls_through_when_the_lower_group_does_not_clear() -> None:
    m = manager(3, eta=1)
    snap = snapshot(instance(0, 2, HEAVY), instance(1, 3, MODERATE))
    [(inst, _, v)] = route(snap, initial(1), m.sketch())
    assert (inst, v) == (1, 3)


def test_best_gain_within_a_version_group() -> None:
    snap = snapshot(instance(0, 3, MODERATE), instance(1, 3), instance(2, 3, HEAVY))
    [(inst, _, _)] = route(snap, initial(1), manager(3).sketch())
    assert inst == 1


def test_withholding_stops_lower_priority_queues() -> None:
    m = manager(3, eta=2)
    head = partial(v_traj=3)  # only instance 1 (version 3) may take it, and it is heavy
    snap = snapshot(instance(0, 2), instance(1, 3, HEAVY))
    # The initial trajectories could go to the idle instance 0, but they rank lower.
    assert route(snap, [*initial(1, 3), head], m.sketch()) == []


def test_mlq_routes_staler_trajectories_first() -> None:
    old, new = partial(v_traj=1), partial(v_traj=3)
    first, *_ = initial(1)
    snap = snapshot(instance(0, 3), instance(1, 3))
    routes = route(snap, [first, new, old], manager(3, eta=2).sketch())
    assert [t for _, t, _ in routes] == [old.traj_id, new.traj_id, first.traj_id]


def test_interchangeable_trajectories_spread_as_gains_fall() -> None:
    snap = snapshot(*(instance(i, 3) for i in range(4)))
    routes = route(snap, initial(1, 8), manager(3, batch=2).sketch())
    assert sorted(inst for inst, _, _ in routes) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [inst for inst, _, _ in routes[:4]] == [0, 1, 2, 3]


def test_later_decisions_see_earlier_reservations_in_the_sketch() -> None:
    m = manager(3, eta=0, batch=1)  # one group fits
    snap = snapshot(instance(0, 3), instance(1, 3))
    routes = route(snap, [*initial(1, 2), *initial(2, 2)], m.sketch())
    assert len(routes) == 2  # the second group is withheld (no buffer left)
    assert m.verify(3)  # the real manager was not touched


def test_routing_updates_the_working_snapshot() -> None:
    fleet = Fleet(snapshot(instance(0, 3)))
    ThroughputRouting(COST, 0.3).route(
        fleet, TrajectoryPool(initial(1, 2, 500)), manager(3).sketch()
    )
    assert fleet.n_run[0] == 2 and fleet.kv[0] == 1_000


# -- the bucketed, vectorised loop decides exactly what Algorithm 3 as written decides ------


def algorithm3_as_written(
    fleet: Fleet, ts: list[TrajectoryView], sketch: AdmissionSketch, mu: float = 0.3
) -> list[tuple[int, int, int]]:
    """Appendix D's pseudocode, instance by instance, with Eq. 3 evaluated per instance."""
    n, kv = fleet.n_run.tolist(), fleet.kv.tolist()
    wait, version = fleet.n_wait.tolist(), fleet.version.tolist()
    out = []
    for _, queue in TrajectoryPool(ts).levels():
        for t in queue:
            candidates = [
                i
                for i in range(len(fleet))
                if (t.v_traj is None and sketch.verify(version[i], t.group_id))
                or (t.v_traj is not None and version[i] >= t.v_traj)
            ]
            if not candidates:
                return out
            threshold = mu * COST.ideal_gain(t.length)
            selected = None
            for v in sorted({version[i] for i in candidates}):
                group = [i for i in candidates if version[i] == v]
                gains = [COST.marginal_gain(n[i], kv[i], wait[i], t.length) for i in group]
                best = max(range(len(group)), key=lambda k: (gains[k], -k))
                if gains[best] >= threshold:
                    selected = group[best]
                    break
            if selected is None:
                return out
            v_traj = version[selected] if t.v_traj is None else t.v_traj
            if t.v_traj is None:
                sketch.reserve(t.group_id, t.traj_id, v_traj)
            out.append((fleet.ids[selected], t.traj_id, v_traj))
            n[selected] += 1
            kv[selected] += COST.k5 * t.length
    return out


@st.composite
def routing_cases(draw: st.DrawFn) -> tuple[Snapshot, list[TrajectoryView], StalenessManager]:
    version = draw(st.integers(1, 5))
    eta = draw(st.integers(0, 2))
    m = manager(version, eta=eta, batch=draw(st.integers(1, 6)), group=draw(st.integers(1, 4)))
    insts = []
    for i in range(draw(st.integers(1, 7))):
        v = draw(st.integers(max(0, version - 3), version))
        run = [draw(st.sampled_from([100, 900, 5_000]))] * draw(st.integers(0, 50))
        insts.append(instance(i, v, run, wait=draw(st.sampled_from([0, 0, 0, 1]))))
    ts: list[TrajectoryView] = []
    for g in range(draw(st.integers(0, 8))):
        ts += initial(g, draw(st.integers(1, 4)), draw(st.sampled_from([100, 700, 3_000])))
    for _ in range(draw(st.integers(0, 6))):
        ts.append(
            partial(draw(st.integers(max(0, version - 3), version)), draw(st.integers(50, 9_000)))
        )
    return snapshot(*insts), draw(st.permutations(ts)), m


@settings(max_examples=300, deadline=None)
@given(routing_cases())
def test_matches_algorithm3_as_written(
    case: tuple[Snapshot, list[TrajectoryView], StalenessManager],
) -> None:
    snap, ts, m = case
    assert route(snap, ts, m.sketch()) == algorithm3_as_written(Fleet(snap), ts, m.sketch())
