"""The freshness rule (coordinator/freshness.py): eta as a ceiling, not a target.

Each test builds the rule's inputs by hand (the trainer's pace, the groups' completions,
the manager's window) and checks what it holds back, or runs whole cycles against the
real staleness manager (``plan_cycle``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import CoordinatorConfig, Reservation, Route, Snapshot, TrajRecord, plan_cycle
from coordinator.config import ConfigError, FreshnessConfig
from coordinator.fleet import Fleet
from coordinator.freshness import FreshnessRule, TrainerPace, quantile
from staleness import StalenessConfig, StalenessManager
from tests.coordinator.builders import COST, initial, instance, manager, snapshot, strategies

# every response 100 tokens: on an idle instance a group takes about 1.3 s (Table 4)
LENGTH = 100


def trained(rule: FreshnessRule, step_s: float, steps: int = 3, *, start: float = 0.0) -> float:
    """The trainer took ``steps`` buffers, ``step_s`` apart, never waiting; returns the
    time of the last Consume (the trainer is busy from there)."""
    t = start
    for i in range(steps):
        if i:
            t += step_s
            rule.pace.asked(t)
        rule.consumed(t)
    return t


def admit(rule: FreshnessRule, g: int, t0: float, estimate: float | None) -> None:
    """Group ``g``'s first Reserve at ``t0``, estimated then to take ``estimate`` s."""
    rule._estimate, kept = estimate, rule._estimate
    rule.note([Route(0, (g,), (Reservation(g, g, 0),))], t0)
    rule._estimate = kept


def learn(rule: FreshnessRule, lateness: float, buffers: int = 4, *, base: int = 10_000) -> None:
    """``buffers`` consumed buffers of one group each, started at 0 with the rule's last
    estimate (0 before it had one) and complete ``lateness`` s after it."""
    estimate = rule._estimate or 0.0
    for b in range(buffers):
        g = base + b
        admit(rule, g, 0.0, estimate)
        rule.finished(g, LENGTH)
        rule.completed(g, estimate + lateness)
        rule.learn()


def ready_rule(step_s: float = 10.0, lateness: float = 0.5) -> tuple[FreshnessRule, float]:
    rule = FreshnessRule(COST)
    learn(rule, lateness)
    return rule, trained(rule, step_s)


def groups(n: int, size: int = 1, first: int = 0) -> list[TrajRecord]:
    return [t for g in range(first, first + n) for t in initial(g, size, LENGTH)]


def idle_fleet(version: int = 0, n: int = 2) -> Fleet:
    return Fleet(snapshot(*(instance(i, version) for i in range(n))))


def test_quantile_is_the_smallest_value_covering_the_share() -> None:
    assert quantile([], 0.9) == 0.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile(range(10), 0.9) == 8
    assert quantile(range(10), 0.99) == 9


def test_pace_measures_steps_and_waits() -> None:
    pace = TrainerPace()
    assert pace.wants_at(0.0) is None  # nothing measured
    pace.count_waits = True
    pace.served(0.0)
    pace.asked(8.0)
    pace.asked(9.0)  # a repeated ask keeps the first
    assert pace.waiting and pace.wants_at(9.5) == 9.5  # waiting: it wants it now
    pace.served(10.0)
    assert pace.step_s == 8.0
    assert pace.wants_at(11.0) == 18.0
    assert pace.wants_at(30.0) == 30.0  # overdue: any moment now
    assert pace.wait_share() == pytest.approx((0.0 + 2.0) / 2 / 8.0)


def test_it_holds_new_groups_while_the_trainer_binds() -> None:
    rule, served = ready_rule(step_s=10.0)
    m = manager(0, eta=3, batch=2)
    held = rule.hold(groups(8), m.sketch(), idle_fleet(), served + 1.0)
    # the trainer wants buffer 0 in 9 s; a group needs about 1.3 + 0.5 s
    assert held == set(range(8))
    assert rule.state.active and not rule.state.giving_way
    # 1 s before the trainer wants buffer 0, its two groups start, the rest waits
    held = rule.hold(groups(8), m.sketch(), idle_fleet(), served + 9.0)
    assert held == set(range(2, 8))


def test_the_whole_cycle_routes_only_what_the_rule_admits() -> None:
    m = manager(0, eta=3, batch=2)
    strat = strategies(freshness=FreshnessConfig(enabled=True))
    rule = strat.freshness
    assert rule is not None
    learn(rule, 0.5)
    served = trained(rule, 10.0)
    snap = Snapshot(tuple(instance(i, 0) for i in range(2)), served + 9.0)
    commands = plan_cycle(snap, groups(8), 0, m.sketch(), strat)
    started = {r.group_id for c in commands if isinstance(c, Route) for r in c.reservations}
    assert started == {0, 1}
    # off, the same cycle starts everything the window holds: eta + 1 buffers of 2
    off = strategies()
    commands = plan_cycle(snap, groups(8), 0, m.sketch(), off)
    started = {r.group_id for c in commands if isinstance(c, Route) for r in c.reservations}
    assert started == set(range(8))


def test_the_buffer_the_trainer_waits_for_is_never_delayed() -> None:
    rule, served = ready_rule(step_s=10.0)
    rule.pace.asked(served + 2.0)  # its step was short: it waits already
    m = manager(0, eta=3, batch=2)
    held = rule.hold(groups(8), m.sketch(), idle_fleet(), served + 2.5)
    assert held == set(range(2, 8))  # buffer 0's two groups start; later ones are not due


def test_it_gives_way_while_the_trainer_waits() -> None:
    """The rollout binds: the trainer waits for every buffer, and admission is today's."""
    rule = FreshnessRule(COST)
    learn(rule, 0.5)
    rule.pace.count_waits = True
    t = 0.0
    rule.consumed(t)
    for _ in range(4):
        rule.pace.asked(t + 10.0)
        t += 14.0  # 4 s waiting for each buffer
        rule.consumed(t)
    m = manager(0, eta=3, batch=2)
    assert rule.hold(groups(8), m.sketch(), idle_fleet(), t + 1.0) == set()
    assert rule.state.giving_way


def test_a_late_history_raises_the_margin_and_starts_groups_earlier() -> None:
    m = manager(0, eta=3, batch=2)
    rule, served = ready_rule(step_s=10.0, lateness=0.5)
    before = rule.margin_s
    held_before = rule.hold(groups(8), m.sketch(), idle_fleet(), served + 1.0)
    learn(rule, 25.0, buffers=32, base=20_000)  # groups finished 25 s after their estimate
    assert rule.margin_s > before + 20.0
    held_after = rule.hold(groups(8), m.sketch(), idle_fleet(), served + 1.0)
    # buffer 0 is wanted in 9 s, buffer 1 in 19: both now within the 26 s a group needs
    assert held_before == set(range(8)) and held_after == set(range(4, 8))
    learn(rule, 40.0, buffers=32, base=30_000)
    assert rule.hold(groups(8), m.sketch(), idle_fleet(), served + 1.0) == set()  # all of eta


def test_the_margin_learns_when_buffers_fill_not_how_long_one_group_took() -> None:
    """Buffers of 2. Groups 0 and 1 start at 0, groups 2 and 3 at 5, each estimated at
    1 s. Group 1 straggles to 20: occupied groups move to the earliest buffer with room,
    so the first buffer fills at 6 with groups 0 and 2 (6 s after its admissions: 5 late),
    and the second at 20 with groups 3 and 1 (15 s after its admissions at 5: 14 late).
    Timed one by one the groups would read 0, 0 and 0, 19: nothing learned for the first
    buffer, and the straggler's whole time for the second."""
    rule = FreshnessRule(COST, quantile=0.5)
    for g, t0 in enumerate([0.0, 0.0, 5.0, 5.0]):
        admit(rule, g, t0, 1.0)
    for g, done in [(0, 1.0), (2, 6.0)]:
        rule.completed(g, done)
    rule.consumed(6.0)
    for g, done in [(3, 6.0), (1, 20.0)]:
        rule.completed(g, done)
    rule.consumed(20.0)
    assert sorted(rule._lateness) == [5.0, 14.0]
    assert rule.margin_s == 5.0  # the median
    rule.consumed(21.0)  # no completion since: no sample
    assert len(rule._lateness) == 2
    rule.q = 0.9
    assert rule.margin_s == 14.0


def test_dropped_groups_leave_the_count() -> None:
    rule = FreshnessRule(COST, quantile=0.5)
    admit(rule, 0, 0.0, 1.0)
    admit(rule, 1, 0.0, 1.0)
    admit(rule, 2, 5.0, 1.0)
    rule.dropped([0])  # never completes: the next completions count against 0 and 5
    rule.completed(1, 3.0)  # 3 s after 0: 2 late
    rule.completed(2, 9.0)  # 4 s after 5: 3 late (against 0 it would be 8)
    rule.consumed(9.0)
    assert list(rule._lateness) == [3.0]
    # a group dropped after its admission was counted against an earlier completion
    admit(rule, 3, 10.0, 1.0)
    admit(rule, 4, 12.0, 1.0)
    rule.completed(4, 13.0)  # counted against 3's admission (10): 2 late
    rule.dropped([3, 99])  # 3's admission was counted already: 4's leaves; 99 unknown
    assert not rule._unmatched and not rule._open
    rule.completed(5, 14.0)  # a group admitted before the rule saw it (a resume)
    rule.consumed(14.0)
    assert list(rule._lateness) == [3.0, 2.0]


def test_completions_of_groups_admitted_before_any_estimate_teach_nothing() -> None:
    rule = FreshnessRule(COST)
    admit(rule, 0, 0.0, None)
    rule.completed(0, 50.0)
    rule.consumed(50.0)
    assert not rule._lateness and rule.margin_s == 0.0


def test_admissions_start_the_clock_of_new_groups_only() -> None:
    rule, served = ready_rule()
    m = manager(0, eta=3, batch=2)
    rule.hold([], m.sketch(), idle_fleet(), served)
    estimate = rule.state.estimate_s
    assert estimate > 0.0
    rule.note([Route(0, (1, 2), (Reservation(7, 1, 0), Reservation(7, 2, 0)))], 3.0)
    rule.note([Route(1, (3,), (Reservation(7, 3, 0),))], 4.0)
    assert rule._open[7] == (3.0, estimate)
    assert list(rule._unmatched) == [(3.0, estimate)]  # one admission, counted once


def test_it_holds_nothing_before_it_has_measured_or_at_eta_0() -> None:
    m = manager(0, eta=3, batch=2)
    fresh = FreshnessRule(COST)
    assert fresh.hold(groups(8), m.sketch(), idle_fleet(), 1.0) == set()  # no step, no samples
    learn(fresh, 0.5)
    assert fresh.hold(groups(8), m.sketch(), idle_fleet(), 1.0) == set()  # no step yet
    rule, served = ready_rule()
    sync = manager(0, eta=0, batch=2)
    assert rule.hold(groups(8), sync.sketch(), idle_fleet(), served + 1.0) == set()
    assert not rule.state.active


def test_groups_already_started_are_never_held() -> None:
    rule, served = ready_rule(step_s=10.0)
    m = manager(0, eta=3, batch=2, group=2)
    m.reserve(0, 900, 0)  # group 0 has one member running
    ts = [*initial(0, 1, LENGTH), *groups(4, size=2, first=1)]
    held = rule.hold(ts, m.sketch(), idle_fleet(), served + 1.0)
    assert 0 not in held and held == {1, 2, 3, 4}


def test_freshness_is_switched_by_the_config() -> None:
    assert strategies().freshness is None
    on = CoordinatorConfig(freshness=FreshnessConfig(enabled=True, quantile=0.95))
    s = strategies(**{"freshness": on.freshness})
    assert s.freshness is not None and s.freshness.q == 0.95


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enabled": "yes"}, "freshness.enabled='yes' must be true or false"),
        ({"quantile": 1.0}, "freshness.quantile=1.0 is out of range"),
        ({"quantile": 0.2}, "freshness.quantile=0.2 is out of range"),
        ({"give_way": -0.1}, "freshness.give_way=-0.1 is out of range"),
        ({"give_way": True}, "freshness.give_way=True is out of range"),
    ],
)
def test_bad_freshness_settings_name_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        FreshnessConfig(**kwargs)  # type: ignore[arg-type]


# -- properties --------------------------------------------------------------------------


@st.composite
def paced_worlds(
    draw: st.DrawFn,
) -> tuple[StalenessManager, list[TrajRecord], Snapshot, int, float]:
    eta = draw(st.integers(0, 4))
    batch = draw(st.integers(1, 4))
    G = draw(st.integers(1, 3))
    version = draw(st.integers(0, 4))
    m = StalenessManager(StalenessConfig(eta=eta, batch_size=batch, group_size=G), version)
    ps = draw(st.integers(max(0, version - 1), version))
    ids = itertools.count()
    ts: list[TrajRecord] = []
    for gid in range(draw(st.integers(0, 12))):
        started = draw(st.integers(0, G - 1))
        v = draw(st.integers(max(0, version - eta), version))
        for k in range(G):
            tid = next(ids)
            if k < started and m.verify(v, gid):
                m.reserve(gid, tid, v)  # running somewhere: not in the TS
            else:
                ts.append(TrajRecord(tid, gid, None, LENGTH, LENGTH))
    n = draw(st.integers(1, 4))
    snap = Snapshot(tuple(instance(i, ps) for i in range(n)), draw(st.floats(0.0, 50.0)))
    return m, ts, snap, ps, draw(st.floats(0.0, 60.0))


@settings(max_examples=200, deadline=None)
@given(paced_worlds(), st.floats(0.5, 30.0), st.floats(-5.0, 40.0))
def test_the_rule_only_removes_new_groups_and_never_breaks_eta(
    world: tuple[StalenessManager, list[TrajRecord], Snapshot, int, float],
    step_s: float,
    lateness: float,
) -> None:
    m, ts, snap, ps, served = world
    strat = strategies(freshness=FreshnessConfig(enabled=True))
    rule = strat.freshness
    assert rule is not None
    learn(rule, lateness)
    trained(rule, step_s, start=served - 2 * step_s)
    sketch = m.sketch()
    held = rule.hold(ts, sketch, Fleet(snap), snap.taken_at)
    assert all(not sketch.tracks(g) for g in held)  # never a started group
    if m.eta == 0:
        assert not held
    commands = plan_cycle(snap, ts, ps, m.sketch(), strat)
    for c in commands:
        if isinstance(c, Route):
            for r in c.reservations:
                assert r.group_id not in held  # recomputed the same in the cycle
                m.reserve(r.group_id, r.traj_id, r.v_traj)  # raises beyond eta
    view = StalenessManager.restore(m.export_state()).view()
    for buf in view.buffers:
        assert len(buf.entries) <= buf.capacity
        for entry in buf.entries:
            assert entry.version <= buf.version <= entry.version + view.eta


@settings(max_examples=200, deadline=None)
@given(paced_worlds(), st.floats(0.5, 30.0))
def test_a_waiting_trainer_always_gets_its_buffer_started(
    world: tuple[StalenessManager, list[TrajRecord], Snapshot, int, float], step_s: float
) -> None:
    """Whatever the pace and margin, while the trainer waits the groups its buffer lacks
    are not held."""
    m, ts, snap, _, served = world
    rule = FreshnessRule(COST)
    learn(rule, 0.0)
    trained(rule, step_s, start=served - 2 * step_s)
    rule.pace.asked(snap.taken_at)
    sketch = m.sketch()
    held = rule.hold(ts, sketch, Fleet(snap), snap.taken_at)
    new = list(dict.fromkeys(t.group_id for t in ts if not sketch.tracks(t.group_id)))
    room = max(0, sketch.capacity - sketch.tracked)  # what buffer ``version`` still lacks
    assert not set(new[:room]) & held
