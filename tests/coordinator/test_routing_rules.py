"""The routing rules beyond Algorithm 3 (coordinator/routing.py, gains.py): the fill rule
and per-instance speeds, decision for decision on small cases, and the gains routing and
the synchronisation probe compare being the same numbers.

With Table 4's coefficients, a 100K-token budget and 100-token trajectories (see
test_routing.py): HEAVY (80 running, 80K KV) does not clear mu = 0.3 (gain 22.6 < 24).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import Snapshot, TrajectoryView
from coordinator.cost_model import CostModel, SpeculationProfile
from coordinator.fleet import Fleet
from coordinator.gains import FILL_BONUS, GainTable, routing_gains, spare
from coordinator.pool import TrajectoryPool
from coordinator.routing import ThroughputRouting, VersionBuckets
from tests.coordinator.builders import COST, initial, instance, manager, partial, snapshot

HEAVY = [1_000] * 80
# the engines decode speculatively (coordinator/cost_model.py): per-instance tokens per step
SPEC = COST.with_speculation(SpeculationProfile(0.8))


def route(
    snap: Snapshot,
    ts: list[TrajectoryView],
    *,
    fill_steps: int | None,
    speed: list[float] | None = None,
) -> list[int]:
    """Instance id of every decision, in order."""
    fleet = Fleet(snap)
    if speed is not None:
        fleet.speed = np.array(speed)
    routing = ThroughputRouting(COST, 0.3, fill_steps)
    placements = routing.route(fleet, TrajectoryPool(ts), manager(3, batch=64).sketch())
    return [fleet.ids[p.pos] for p in placements]


def test_spare_counts_the_batchs_growth() -> None:
    # 80 running + the new one, 100 steps of growth = 8,100 tokens, plus its 100 tokens
    assert spare(COST, np.array([80.0]), np.array([91_800.0]), 100, 100).tolist() == [True]
    assert spare(COST, np.array([80.0]), np.array([91_801.0]), 100, 100).tolist() == [False]


def test_mu_withholds_from_a_busy_instance_only_without_the_fill_rule() -> None:
    snap = snapshot(instance(0, 3, HEAVY))  # 80K of 100K: room for 100 more steps
    assert route(snap, initial(1), fill_steps=None) == []  # Algorithm 3: withheld
    assert route(snap, initial(1), fill_steps=100) == [0]  # KV to spare: routed
    assert route(snap, initial(1), fill_steps=300) == []  # 300 steps would not fit


def test_the_fill_rule_leaves_partial_trajectories_to_mu() -> None:
    snap = snapshot(instance(0, 3, HEAVY))
    assert route(snap, [partial(3, 100)], fill_steps=None) == []
    assert route(snap, [partial(3, 100)], fill_steps=100) == []  # a prefix to re-prefill
    assert route(snap, initial(1), fill_steps=100) == [0]


def test_the_fill_rule_prefers_any_instance_with_room_then_gains() -> None:
    # Both have room; the less loaded one gains more and takes both.
    snap = snapshot(instance(0, 3, [1_000] * 30), instance(1, 3, [1_000] * 10))
    assert route(snap, initial(1, 2), fill_steps=100) == [1, 1]
    # Only the busy one has room for 100 steps: it takes them although mu would not.
    snap = snapshot(instance(0, 3, HEAVY), instance(1, 3, [49_950, 49_950]))
    assert route(snap, initial(2, 2), fill_steps=100) == [0, 0]


def test_fresh_admission_starts_new_work_only_at_the_ps_version() -> None:
    # Instance 0 lags at version 2 and is empty: the waterfall (oldest version first)
    # would start the new trajectory there, at version 2.
    snap = snapshot(instance(0, 2), instance(1, 3, [1_000] * 10))
    sketch = manager(3, batch=64).sketch  # eta = 1: version 2 is still admissible

    def placed(routing: ThroughputRouting, ts: list[TrajectoryView], ps: int | None) -> list:
        fleet = Fleet(snap)
        return [
            (fleet.ids[p.pos], p.v_traj)
            for p in routing.route(fleet, TrajectoryPool(ts), sketch(), ps)
        ]

    paper, fresh = ThroughputRouting(COST, 0.3), ThroughputRouting(COST, 0.3, fresh=True)
    assert placed(paper, initial(1), 3) == [(0, 2)]
    assert placed(fresh, initial(1), 3) == [(1, 3)]
    assert placed(fresh, initial(1), None) == [(0, 2)]  # no PS version given: as the paper
    # A partial trajectory still resumes on the lagging instance (Algorithm 2).
    assert placed(fresh, [partial(2)], 3) == [(0, 2)]
    # With the whole fleet behind the PS nothing new starts until a Pull.
    snap = snapshot(instance(0, 2), instance(1, 2))
    assert placed(fresh, initial(1), 3) == []


def test_a_started_group_is_placed_whole() -> None:
    """Algorithm 3 withholds trajectory by trajectory and may stop inside a group. With
    whole_groups the pass places the rest of a group it started wherever there is room,
    even below mu, and still stops before the next group; never into a queue."""
    sketch = manager(3, batch=64, group=16).sketch

    def placed(snap: Snapshot, ts: list[TrajectoryView], whole: bool) -> list[tuple]:
        fleet = Fleet(snap)
        routing = ThroughputRouting(COST, 0.3, None, whole_groups=whole)
        return [
            (fleet.ids[p.pos], p.traj.group_id, p.v_traj)
            for p in routing.route(fleet, TrajectoryPool(ts), sketch())
        ]

    busy = snapshot(instance(0, 3, [1_000] * 70))
    ts = initial(1, 16) + initial(2, 16)
    assert placed(busy, ts, False) == [(0, 1, 3)] * 5  # mu stops inside group 1
    assert placed(busy, ts, True) == [(0, 1, 3)] * 16  # group 1 whole; group 2 waits
    # The rest goes where there is room: instance 0 has KV for two more trajectories.
    snap = snapshot(instance(0, 3, [1_000] * 5, kv=99_750), instance(1, 3, [1_000] * 70))
    assert [i for i, _, _ in placed(snap, initial(3, 16), False)] == [0, 0, 1, 1, 1, 1, 1]
    assert [i for i, _, _ in placed(snap, initial(3, 16), True)] == [0, 0] + [1] * 14
    full = snapshot(instance(0, 3, [1_000] * 5, kv=99_750))
    assert len(placed(full, initial(4, 16), True)) == 2


def test_a_slow_instance_gets_less() -> None:
    # Equal loads; instance 1 runs at half speed, so its gain is halved.
    snap = snapshot(instance(0, 3, [1_000] * 10), instance(1, 3, [1_000] * 10))
    placed = route(snap, initial(1, 16), fill_steps=None, speed=[1.0, 2.0])
    assert placed.count(0) > placed.count(1)
    assert route(snap, initial(2, 16), fill_steps=None).count(0) == 8  # equal speeds split


@settings(max_examples=200, deadline=None)
@given(
    n=st.lists(st.integers(0, 120), min_size=1, max_size=6),
    fill=st.sampled_from([None, 0, 50, 400]),
    data=st.data(),
)
def test_the_table_and_the_probe_compute_the_same_gains(
    n: list[int], fill: int | None, data: st.DataObject
) -> None:
    """Algorithm 4's probe (routing_gains) must see exactly what routing's GainTable sees,
    or a tentative pass would disagree with the real one on ties (with speculation too)."""
    cost = data.draw(st.sampled_from([COST, SPEC]))
    k = len(n)
    kv = np.array([data.draw(st.floats(0, COST.kv_budget)) for _ in range(k)])
    queued = np.array([data.draw(st.booleans()) for _ in range(k)])
    speed = np.array([data.draw(st.floats(0.3, 3.0)) for _ in range(k)])
    length = float(data.draw(st.sampled_from([80, 2_000, 30_000])))
    nn = np.array(n, dtype=np.float64)
    table = GainTable(cost, nn.copy(), kv.copy(), queued, [0], [k], 1.0 / speed, fill)
    j, g = table.best(0, length)
    probe = routing_gains(cost, nn, kv, queued, 1.0 / speed, length, fill)
    assert g == probe[j] and (probe <= g).all()
    # After a placement the table's incremental update matches a fresh computation.
    if np.isfinite(g):
        table.place(j, length)
        nn[j] += 1
        kv[j] += cost.k5 * length
        _, g2 = table.best(0, length)
        assert g2 == routing_gains(cost, nn, kv, queued, 1.0 / speed, length, fill).max()


@settings(max_examples=100, deadline=None)
@given(
    n=st.lists(st.integers(0, 120), min_size=2, max_size=40),
    fill=st.sampled_from([None, 0, 400]),
    data=st.data(),
)
def test_a_planned_table_answers_as_an_unplanned_one(
    n: list[int], fill: int | None, data: st.DataObject
) -> None:
    """GainTable.plan computes rows of gains ahead and fixes the instances routed to since
    in Python: every answer, ties included, must be the unplanned table's, bit for bit,
    whether the lengths come as planned, repeat, or come out of the plan."""
    k = len(n)
    kv = np.array([data.draw(st.floats(0, COST.kv_budget)) for _ in range(k)])
    queued = np.array([data.draw(st.booleans()) for _ in range(k)])
    speed = np.array([data.draw(st.floats(0.3, 3.0)) for _ in range(k)])
    cut = data.draw(st.integers(1, k - 1))
    starts, ends = [0, cut], [cut, k]
    lengths = data.draw(st.lists(st.sampled_from([80, 700, 2_000, 9_000]), max_size=60))
    asked = data.draw(st.lists(st.sampled_from([80, 700, 2_000, 30_000]), max_size=10))
    nn = np.array(n, dtype=np.float64)
    cost = data.draw(st.sampled_from([COST, SPEC]))
    tables = [GainTable(cost, nn.copy(), kv.copy(), queued, starts, ends, 1 / speed, fill)]
    tables.append(GainTable(cost, nn.copy(), kv.copy(), queued, starts, ends, 1 / speed, fill))
    tables[0].fill_for(fill is not None)
    tables[1].fill_for(fill is not None)
    tables[1].plan([float(x) for x in lengths], data.draw(st.integers(0, 2)))
    for length in [*lengths, *asked]:  # the plan, then lengths it does not have next
        answers = [[t.best(b, length) for b in (1, 0, 1)] for t in tables]
        assert answers[0] == answers[1]
        j, g = answers[0][1]
        if np.isfinite(g):
            for t in tables:
                t.place(j, length)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    fill=st.sampled_from([None, 400]),
    cost=st.sampled_from([COST, SPEC]),
    first=st.integers(0, 2),
    ties=st.booleans(),
)
def test_a_long_plan_answers_as_an_unplanned_table(
    seed: int, fill: int | None, cost: CostModel, first: int, ties: bool
) -> None:
    """A plan longer than the rows computed at once (gains.AHEAD), more routes than a row
    is answered past (gains.MAX_DIRTY), three buckets and a length per trajectory, as a
    level of partial trajectories asks: the planned rows' best, and their argmax once the
    best was routed to, must each give the unplanned table's answer. ``ties``: loads and
    lengths on a coarse grid, so that an instance routed to often takes the load, and the
    gains, of another (which of two equal gains wins is argmax's: the lower position)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(40, 90))
    nn = rng.integers(0, 10 if ties else 60, k).astype(np.float64)
    kv = rng.integers(0, 10 if ties else 40, k) * 1_000.0
    queued = rng.random(k) < 0.1
    weight = np.ones(k) if ties else 1 / rng.choice([1.0, 1.5], k)
    a, b = sorted(rng.choice(np.arange(1, k), 2, replace=False).tolist())
    starts, ends = [0, a, b], [a, b, k]
    lengths = (rng.integers(1, 3, 150) * 1_000 if ties else rng.integers(50, 3_000, 150)).tolist()
    plain = GainTable(cost, nn.copy(), kv.copy(), queued, starts, ends, weight, fill)
    planned = GainTable(cost, nn.copy(), kv.copy(), queued, starts, ends, weight, fill)
    for t in (plain, planned):
        t.fill_for(fill is not None)
    planned.plan([float(x) for x in lengths], first)
    for length in lengths:
        answers = [[t.best(b, length) for b in range(first, 3)] for t in (plain, planned)]
        assert answers[0] == answers[1]
        fits = [j for j, g in answers[0] if np.isfinite(g)]
        if fits:  # route as the waterfall would, to one of the answers
            j = fits[int(rng.integers(len(fits)))]
            for t in (plain, planned):
                t.place(j, length)
    assert planned.n.tolist() == plain.n.tolist() and planned.kv.tolist() == plain.kv.tolist()


def test_a_planned_row_breaks_a_tie_with_an_instance_routed_to_as_argmax() -> None:
    """Instance 0, idle, is every row's best until a route gives it the load of 1 and 2:
    for the next planned length its gain then equals theirs, and the lowest position
    wins, as the unplanned table's argmax has it (the path of a row whose best was routed to)."""
    nn = np.array([0.0, 1.0, 1.0])
    kv = np.array([0.0, COST.k5 * 1_000, COST.k5 * 1_000])
    tables = [GainTable(COST, nn.copy(), kv.copy(), np.zeros(3, bool), [0], [3]) for _ in "ab"]
    tables[1].plan([1_000.0, 1_500.0])
    assert [t.best(0, 1_000.0)[0] for t in tables] == [0, 0]
    for t in tables:
        t.place(0, 1_000.0)
    plain, planned = (t.best(0, 1_500.0) for t in tables)
    assert planned == plain and plain[0] == 0
    assert tables[0].gain_at(1, 1_500.0) == plain[1]  # a tie indeed


def test_a_planned_row_with_no_other_room_answers_as_argmax() -> None:
    """Instances 0 and 2 queue (-inf for every length), so 1 is every row's best; routed
    to, it is left room for a short trajectory only. For a long one every gain is then
    -inf and argmax answers the first position; for a short one, instance 1 still (the
    row's argmax, with the routed-to instance read as -inf, is the path taken)."""
    k5 = COST.k5
    nn = np.array([3.0, 1.0, 3.0])
    kv = np.array([0.0, COST.kv_budget - k5 * (1_000.0 + 600.0), 0.0])
    queued = np.array([True, False, True])
    for later, expect in ((1_000.0, 0), (500.0, 1)):
        tables = [GainTable(COST, nn.copy(), kv.copy(), queued, [0], [3]) for _ in "ab"]
        tables[1].plan([1_000.0, later])
        assert [t.best(0, 1_000.0)[0] for t in tables] == [1, 1]
        for t in tables:
            t.place(1, 1_000.0)
        plain, planned = (t.best(0, later) for t in tables)
        assert planned == plain and plain[0] == expect
        assert np.isfinite(plain[1]) == (expect == 1)


def test_the_bonus_only_applies_where_the_trajectory_fits() -> None:
    g = routing_gains(
        COST,
        np.array([0.0, 0.0]),
        np.array([0.0, 99_950.0]),
        np.array([False, False]),
        np.ones(2),
        100.0,
        0,
    )
    assert g[0] > FILL_BONUS / 2 and g[1] == -np.inf


def test_bucket_order_is_kept_with_speeds() -> None:
    fleet = Fleet(snapshot(instance(0, 2), instance(1, 1), instance(2, 2)))
    fleet.speed = np.array([1.0, 3.0, 0.5])
    assert VersionBuckets.of(fleet).order == [1, 0, 2]


def test_fill_steps_is_validated() -> None:
    with pytest.raises(ValueError, match="fill_steps"):
        ThroughputRouting(COST, 0.3, -1)
