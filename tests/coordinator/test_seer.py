"""Seer's context-aware scheduling (coordinator/seer.py) against Algorithm 1 of seer.md,
decision for decision, and the cycle's properties with it on (bound, no trajectory routed
twice or lost)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import (
    ConfigError,
    CoordinatorConfig,
    InstanceSnapshot,
    Pull,
    SeerConfig,
    Snapshot,
    TrajRecord,
    plan_cycle,
)
from coordinator.seer import LengthContext, SeerRouting, chunk_cap, initial_order, seer_order
from coordinator.strategies import build_strategies
from staleness import StalenessConfig, StalenessManager
from tests.coordinator.builders import config as coordinator_config
from tests.coordinator.test_properties import World, routes, worlds

PROMPT = 10


def _t(tid: int, group: int, generated: int = 0, v: int | None = None) -> TrajRecord:
    return TrajRecord(tid, group, v, PROMPT + generated, PROMPT)


def _inst(inst: int, version: int, run: list[TrajRecord]) -> InstanceSnapshot:
    return InstanceSnapshot(inst, sum(t.length for t in run), tuple(run), (), (), version)


def algorithm_1(
    requests: list[TrajRecord], probes: dict[int, int], estimates: dict[int, int | None]
) -> list[int]:
    """A literal transcription of Algorithm 1 (l. 1-18), called until every request is
    scheduled: the ids in the order it returns them. Ties: the first in ``requests``."""
    active = list(requests)
    out = []
    while active:
        q_spec = [r for r in active if probes.get(r.group_id) == r.traj_id]
        c_rest = [r for r in active if probes.get(r.group_id) != r.traj_id]
        if q_spec:  # PICKSFS: smallest generated length
            pick = min(q_spec, key=lambda r: r.length - r.prompt_len)
        else:  # PICKLFS: largest L_g, the cap (None) above any known length
            cap = 1 << 60
            # max() keeps the first of equal keys
            pick = max(
                c_rest,
                key=lambda r: cap if estimates[r.group_id] is None else estimates[r.group_id],
            )
        active.remove(pick)
        out.append(pick.traj_id)
    return out


def test_chunk_cap_is_algorithm_1_lines_19_20() -> None:
    assert chunk_cap(0, 100, 30) == 30
    assert chunk_cap(80, 100, 30) == 100  # min(chunk, ori_max - generated) tokens more
    assert chunk_cap(99, 100, 30) == 100
    assert chunk_cap(40, 100, None) == 100  # divided rollout off: the whole budget


def test_the_estimate_is_the_longest_finished_member_and_the_cap_before() -> None:
    ctx = LengthContext()
    assert ctx.estimate(7) is None  # none finished: the cap
    ctx.finished(7, 70, 120)
    ctx.finished(7, 71, 40)
    assert ctx.estimate(7) == 120
    ctx.finished(7, 72, 300)
    assert ctx.estimate(7) == 300
    acc = ctx.accuracy()
    assert acc.groups == 1 and acc.mean_error == pytest.approx((300 - 120) / 300)
    assert acc.exact == 0


def test_the_probe_is_the_groups_first_member_when_first_seen() -> None:
    ctx = LengthContext()
    ctx.observe([_t(5, 1), _t(4, 1), _t(6, 1), _t(9, 2)])
    assert ctx.is_probe(_t(4, 1)) and ctx.is_probe(_t(9, 2))
    ctx.observe([_t(5, 1), _t(6, 1)])  # the probe left (routed): no new probe is named
    assert not ctx.is_probe(_t(5, 1))


def test_a_small_case_decision_for_decision() -> None:
    """Three groups; group 0's probe finished at 500 tokens, group 1's at 50, group 2 has
    none finished (estimate = the cap). Probes first by generated length, then LFS."""
    ctx = LengthContext()
    trajs = [
        _t(1, 0, 0),
        _t(2, 0, 0),
        _t(4, 1, 0),
        _t(5, 1, 0),
        _t(6, 2, 30),  # group 2's probe, 30 tokens generated
        _t(7, 2, 0),
        _t(8, 3, 5),  # group 3's probe
        _t(9, 3, 0),
    ]
    ctx.observe([_t(0, 0), _t(3, 1), *trajs])  # probes 0 and 3 were routed and finished
    ctx.finished(0, 0, 500)
    ctx.finished(1, 3, 50)
    ctx.finished(3, 10, 20)  # not the probe, but a finished member counts
    order = [t.traj_id for t in seer_order(trajs, ctx)]
    assert order == [8, 6, 7, 1, 2, 4, 5, 9]
    assert order == algorithm_1(trajs, {0: 0, 1: 3, 2: 6, 3: 8}, {0: 500, 1: 50, 2: None, 3: 20})


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 50)), min_size=0, max_size=14
    ),  # (group, generated) per request
    st.dictionaries(st.integers(0, 4), st.integers(1, 60), max_size=5),  # finished lengths
    st.randoms(use_true_random=False),
)
def test_seer_order_is_algorithm_1_repeated(
    requests: list[tuple[int, int]], finished: dict[int, int], rnd: object
) -> None:
    trajs = [_t(i, g, n) for i, (g, n) in enumerate(requests)]
    rnd.shuffle(trajs)  # type: ignore[attr-defined]
    ctx = LengthContext()
    ctx.observe(trajs)
    for g, n in finished.items():
        ctx.finished(g, 1000 + g, n)
    probes = {
        g: min(t.traj_id for t in trajs if t.group_id == g) for g in {t.group_id for t in trajs}
    }
    estimates = {g: finished.get(g) for g in probes}
    got = [t.traj_id for t in seer_order(trajs, ctx)]
    assert got == algorithm_1(trajs, probes, estimates)


def test_started_groups_route_before_fresh_ones_in_the_initial_level() -> None:
    ctx = LengthContext()
    fresh = [_t(20, 5), _t(21, 5)]
    rest = [_t(11, 4), _t(12, 4)]  # group 4's probe (10) is on an instance
    ctx.observe([_t(10, 4), *rest, *fresh])
    ctx.started([4])
    assert [t.traj_id for t in initial_order(fresh + rest, ctx)] == [11, 12, 20, 21]


def test_a_refused_fresh_probe_does_not_stop_a_started_groups_members() -> None:
    """Buffers full of reserved groups: a fresh group is refused, the started group's
    remaining member still routes (with FIFO-by-probe order it would have been behind)."""
    manager = StalenessManager(StalenessConfig(eta=0, batch_size=1, group_size=2))
    manager.reserve(0, 0, 0)  # group 0's probe is on instance 0; the buffer is full
    s = build_strategies(coordinator_config(seer=SeerConfig(enabled=True, chunk_tokens=64)))
    assert isinstance(s.routing, SeerRouting)
    on_inst = TrajRecord(0, 0, 0, PROMPT + 5, PROMPT)
    snapshot = Snapshot((_inst(0, 0, [on_inst]), _inst(1, 0, [])))
    ts = [_t(2, 1), _t(3, 1), _t(1, 0)]  # group 1 is fresh and first in the TS
    commands = plan_cycle(snapshot, ts, 0, manager.sketch(), s)
    routed = [t for r in routes(commands) for t in r.trajs]
    assert routed == [1]


def test_the_version_levels_keep_their_order() -> None:
    """Seer orders within a level; a partial of an older V_traj still goes first."""
    s = build_strategies(coordinator_config(seer=SeerConfig(enabled=True), routing="vanilla"))
    ctx = s.seer
    assert ctx is not None
    old = TrajRecord(1, 0, 0, PROMPT + 900, PROMPT)  # long, not a probe, older V_traj
    new_probe = TrajRecord(5, 1, 1, PROMPT + 1, PROMPT)
    ctx.observe([TrajRecord(0, 0, 0, PROMPT, PROMPT), new_probe])
    manager = StalenessManager(StalenessConfig(eta=1, batch_size=4, group_size=2), 1)
    manager.reserve(0, 1, 0)
    manager.reserve(1, 5, 1)
    snapshot = Snapshot((_inst(0, 1, []),))
    commands = plan_cycle(snapshot, [new_probe, old], 1, manager.sketch(), s)
    routed = [t for r in routes(commands) for t in r.trajs]
    assert routed == [1, 5]


def test_the_switch_is_off_by_default_and_validated() -> None:
    assert CoordinatorConfig().seer.enabled is False
    assert CoordinatorConfig().seer.chunk is None
    assert build_strategies(CoordinatorConfig()).seer is None
    assert SeerConfig(enabled=True, chunk_tokens=16).chunk == 16
    with pytest.raises(ConfigError, match=r"coordinator\.seer\.chunk_tokens"):
        SeerConfig(chunk_tokens=0)
    with pytest.raises(ConfigError, match=r"coordinator\.seer\.enabled"):
        SeerConfig(enabled="yes")  # type: ignore[arg-type]


def _seer_cycle(w: World) -> list:
    routing, sync, migration = w.combo
    s = build_strategies(
        replace(
            coordinator_config(routing=routing, synchronization=sync, migration=migration),
            seer=SeerConfig(enabled=True, chunk_tokens=100),
        )
    )
    assert s.seer is not None
    for t in w.ts:  # some groups have a finished member
        if t.traj_id % 3 == 0:
            s.seer.finished(t.group_id, t.traj_id, t.traj_id * 7 % 500)
    return plan_cycle(w.snapshot, w.ts, w.ps_version, w.manager.sketch(), s)


@settings(max_examples=200, deadline=None)
@given(worlds())
def test_with_seer_routes_never_make_the_manager_violate_eta(w: World) -> None:
    commands = _seer_cycle(w)
    for route in routes(commands):
        for r in route.reservations:
            w.manager.reserve(r.group_id, r.traj_id, r.v_traj)  # raises on a violation
    view = StalenessManager.restore(w.manager.export_state()).view()
    for buf in view.buffers:
        assert len(buf.entries) <= buf.capacity
        for entry in buf.entries:
            assert entry.version <= buf.version <= entry.version + view.eta


@settings(max_examples=200, deadline=None)
@given(worlds())
def test_with_seer_no_trajectory_is_routed_twice_or_lost(w: World) -> None:
    commands = _seer_cycle(w)
    in_ts = {t.traj_id for t in w.ts}
    on_inst = {t.traj_id for s in w.snapshot.instances for t in s.run_trajs + s.wait_trajs}
    routed = [t for r in routes(commands) for t in r.trajs]
    assert len(routed) == len(set(routed))
    assert set(routed) <= in_ts | on_inst
    version = {s.inst: s.inst_version for s in w.snapshot.instances}
    for c in commands:
        if isinstance(c, Pull):
            version[c.inst] = c.version
    partial = {t.traj_id: t.v_traj for t in w.ts if t.v_traj is not None}
    for route in routes(commands):
        for tid in route.trajs:
            if tid in partial:  # Algorithm 2: never to an instance older than V_traj
                assert version[route.inst] >= partial[tid]
