"""Multi-turn work in the coordinator (coordinator/agentic.py): the online tool-wait
estimate, KV locality and the expected returns, each as a pure function; and that the
cost model and the speed estimate see decoding only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator import InstanceSnapshot, Snapshot, TrajRecord
from coordinator.agentic import ToolWaits, expected_returns, move_penalty, stays_home
from coordinator.estimation import SpeedEstimator
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.routing import ThroughputRouting
from coordinator.sync import ThroughputSync
from staleness import StalenessConfig, StalenessManager
from tests.coordinator.builders import COST


def _inst(
    inst: int,
    run: tuple[TrajRecord, ...] = (),
    env: tuple[TrajRecord, ...] = (),
    held: tuple[tuple[int, int], ...] = (),
) -> InstanceSnapshot:
    return InstanceSnapshot(inst, sum(t.length for t in run), run, (), (), 0, env, held)


def _waiting(ids: list[int], length: int = 1_000) -> tuple[TrajRecord, ...]:
    return tuple(TrajRecord(i, 0, 0, length, 50) for i in ids)


def _feed(waits: ToolWaits, durations: list[float], period: float = 1.0) -> float:
    """Trajectories that wait the given seconds, each listed in env_trajs from t to t+d,
    observed every ``period``. Returns the clock at the end."""
    starts = {i: 10.0 * i for i in range(len(durations))}
    ends = {i: starts[i] + d for i, d in enumerate(durations)}
    now, last = 0.0, max(ends.values()) + 2 * period
    while now <= last:
        listed = [i for i in starts if starts[i] <= now < ends[i]]
        snap = Snapshot((_inst(0, env=_waiting(listed)),), now)
        back = [TrajRecord(i, 0, 0, 1_400, 50) for i in starts if now >= ends[i]]
        waits.observe(snap, back)
        now += period
    return now


def test_waits_are_measured_from_the_listings() -> None:
    waits = ToolWaits(min_samples=4)
    _feed(waits, [3.0, 5.0, 8.0, 20.0], period=1.0)
    assert waits.samples == 4
    # each wait is seen to within one period
    assert waits.quantile(0.0) == pytest.approx(3.0, abs=1.0)
    assert waits.quantile(1.0) == pytest.approx(20.0, abs=1.0)


def test_the_prior_answers_until_enough_waits() -> None:
    waits = ToolWaits(min_samples=16, prior_wait_s=10.0)
    _feed(waits, [1.0] * 4)
    # memoryless exponential of the prior's mean, whatever the waited time
    p0 = waits.p_return(0.0, 10.0)
    p100 = waits.p_return(100.0, 10.0)
    assert float(p0) == pytest.approx(1 - math.exp(-1.0))
    assert float(p100) == pytest.approx(float(p0))
    assert waits.residual(50.0) == 10.0


def test_a_heavy_tail_makes_a_long_wait_longer_still() -> None:
    """Conditional on having waited long, the remaining wait grows and the chance of a
    return within the next seconds falls: the property the rules rely on."""
    rng = np.random.default_rng(0)
    waits = ToolWaits(min_samples=16, window=4096)
    waits._waits.extend(np.exp(rng.normal(np.log(2.0), 1.5, 4000)).tolist())  # no snapshots needed
    assert waits.residual(30.0) > waits.residual(1.0) > 0
    assert float(waits.p_return(30.0, 5.0)) < float(waits.p_return(0.5, 5.0))
    # an exponential (no tail) would keep both flat
    flat = ToolWaits(min_samples=16, window=4096)
    flat._waits.extend(rng.exponential(5.0, 4000).tolist())
    assert flat.residual(10.0) == pytest.approx(flat.residual(0.0), rel=0.15)


def test_turn_tokens_are_learned_from_back_to_next_wait() -> None:
    waits = ToolWaits(min_samples=1, prior_turn_tokens=999.0)
    assert waits.turn_tokens() == 999.0
    t = 0.0
    waits.observe(Snapshot((_inst(0, env=_waiting([7], 1_000)),), t), [])
    # back in the TS with its observation (1,400 tokens), then decodes 300 and waits again
    waits.observe(Snapshot((_inst(0),), t + 1), [TrajRecord(7, 0, 0, 1_400, 50)])
    waits.observe(Snapshot((_inst(0),), t + 2), [])
    waits.observe(Snapshot((_inst(0, env=_waiting([7], 1_700)),), t + 3), [])
    assert waits.turn_tokens() == 300.0


def test_move_penalty_is_the_prefill_the_cache_saves() -> None:
    no_cache = move_penalty(COST, 20_000, 0, 10, 0.03)
    assert no_cache == 0.0  # nothing cached: moving costs what staying costs
    cached = move_penalty(COST, 20_000, 19_000, 10, 0.03)
    extra = COST.prefill_seconds(20_000) - COST.prefill_seconds(20_000, 19_000)
    assert cached == pytest.approx(extra * 11 / 0.03)


def test_a_next_turn_stays_where_its_prefix_is_cached() -> None:
    kw = dict(length=20_000, cached=19_500, n_best=10.0, latency_best=0.03, turn_tokens=256.0)
    # a slightly better instance elsewhere does not pay for re-prefilling 19.5K tokens
    assert stays_home(COST, gain_home=20.0, gain_best=22.0, **kw)
    # home cannot run it now: it moves, whatever the cache
    assert not stays_home(COST, gain_home=-math.inf, gain_best=1.0, **kw)
    # nothing cached: any better instance wins
    assert not stays_home(COST, gain_home=20.0, gain_best=22.0, **{**kw, "cached": 0})
    # a much better instance elsewhere over a long turn does pay for it
    long_turn = {**kw, "turn_tokens": 1e6}
    assert not stays_home(COST, gain_home=1.0, gain_best=30.0, **long_turn)


def test_expected_returns_load_the_instance_caching_each_prefix() -> None:
    waits = ToolWaits(min_samples=4)
    waits._waits.extend([1.0, 1.0, 1.0, 100.0])  # most waits are short, one very long
    env0 = _waiting([1, 2], 5_000)
    snap = Snapshot(
        (
            _inst(0, env=env0, held=((1, 5_000), (2, 5_000))),
            _inst(1, run=_waiting([3], 2_000)),
            # listed here but cached nowhere: it loads no one in particular
            _inst(2, env=_waiting([4], 5_000)),
        ),
        10.0,
    )
    waits.observe(snap, [])
    n, kv = expected_returns(Fleet(snap), waits, COST)
    assert n[1] == n[2] == 0.0 and kv[1] == kv[2] == 0.0
    assert 0.0 < n[0] <= 2.0
    assert kv[0] == pytest.approx(n[0] * 5_000)


def test_waiting_trajectories_are_no_decoding_work() -> None:
    """The cost model's n and kv, and the speed estimate, see run_trajs only: adding
    trajectories that wait on tools to a snapshot changes none of them."""
    run = _waiting([10, 11, 12], 3_000)
    plain = Snapshot((_inst(0, run=run),), 0.0)
    agentic = Snapshot(
        (_inst(0, run=run, env=_waiting([20, 21, 22, 23], 9_000), held=((20, 9_000),)),), 0.0
    )
    a, b = Fleet(plain), Fleet(agentic)
    assert (a.n_run == b.n_run).all() and (a.kv == b.kv).all()
    assert (a.throughputs(COST) == b.throughputs(COST)).all()
    assert b.n_env[0] == 4 and b.holder(20) == 0 and b.holder(21) == -1

    def later(snap: Snapshot, dt: float, tokens: int) -> Snapshot:
        s = snap.instances[0]
        grown = tuple(TrajRecord(t.traj_id, 0, 0, t.length + tokens, 50) for t in s.run_trajs)
        return Snapshot(
            (InstanceSnapshot(0, s.kv_cache + 3 * tokens, grown, (), (), 0, s.env_trajs, s.held),),
            dt,
        )

    factors = []
    for snap in (plain, agentic):
        est = SpeedEstimator(COST, min_steps=1)
        est.observe(snap)
        est.observe(later(snap, 10.0, 100))
        factors.append(est.factor(0))
    assert factors[0] == factors[1]


def test_a_pull_drops_the_prefixes_of_the_pulled_instance() -> None:
    snap = Snapshot((_inst(0, held=((1, 100),)), _inst(1, held=((2, 100),))), 0.0)
    fleet = Fleet(snap)
    copy = fleet.copy()
    copy.set_version(0, 5)
    assert copy.holder(1) == -1 and copy.holder(2) == 1
    assert fleet.holder(1) == 0  # the working copy's Pull leaves the original alone


def test_a_prefix_cached_twice_is_held_by_the_instance_with_the_longer_one() -> None:
    # an instance left behind may still cache a shorter, older prefix of a trajectory
    snap = Snapshot(
        (
            _inst(0, held=((1, 100), (2, 300), (3, 200))),
            _inst(1, held=((1, 400), (2, 300))),
            _inst(2, held=((3, 150),)),
        ),
        0.0,
    )
    fleet = Fleet(snap)
    assert fleet.held_by(1) == (1, 400)
    assert fleet.held_by(2) == (0, 300)  # equal ones: the first instance's
    assert fleet.held_by(3) == (0, 200)


def test_expected_returns_drop_the_prefixes_a_pull_cleared() -> None:
    """Asked again after a Pull in the same cycle, the expected returns leave out the
    Pulled instance (its cache is gone) and nothing else; the original fleet, whose copy
    was Pulled, still counts it."""
    waits = ToolWaits(min_samples=4)
    waits.learn([1.0, 1.0, 1.0, 1.0])
    snap = Snapshot(
        (
            _inst(0, env=_waiting([1, 2], 5_000), held=((1, 5_000), (2, 5_000))),
            _inst(1, env=_waiting([3], 3_000), held=((3, 3_000),)),
        ),
        10.0,
    )
    waits.observe(snap, [])
    fleet = Fleet(snap)
    n, kv = expected_returns(fleet, waits, COST)
    assert n[0] > 0.0 and n[1] > 0.0
    copy = fleet.copy()
    copy.set_version(0, 5)
    n2, kv2 = expected_returns(copy, waits, COST)
    assert n2[0] == 0.0 and kv2[0] == 0.0
    assert n2[1] == n[1] and kv2[1] == kv[1]
    again, _ = expected_returns(fleet, waits, COST)
    assert (again == n).all()


def test_tool_pulls_count_the_prefixes_expected_back_as_kv_in_use() -> None:
    """With ``tool_pulls`` the synchronisation weighs a Pull by the cached prefixes it
    would discard that are expected back within a turn's time; off, by decoding KV only."""

    waits = ToolWaits(min_samples=4)
    waits.learn([1.0, 1.0, 1.0, 1.0])  # every wait is short: all expected back soon
    snap = Snapshot(
        (
            _inst(0, run=_waiting([3], 2_000), env=_waiting([1], 5_000), held=((1, 5_000),)),
            _inst(1, run=_waiting([4], 2_000)),
        ),
        10.0,
    )
    waits.observe(snap, [])
    routing = ThroughputRouting(COST, 0.5, waits=waits)
    fleet = Fleet(snap)
    on = ThroughputSync(routing, pull_kv=0.5, returns=True).kv_in_use(fleet)
    off = ThroughputSync(routing, pull_kv=0.5).kv_in_use(fleet)
    assert (off == fleet.kv).all()
    assert on[1] == fleet.kv[1] and on[0] > fleet.kv[0]
    with pytest.raises(ValueError, match="ToolWaits"):
        ThroughputSync(ThroughputRouting(COST, 0.5), returns=True)


def _tool_sync_setup(wait_s: float) -> tuple[ThroughputRouting, StalenessManager]:
    """Routing with fresh admission and tool waits all of ``wait_s`` seconds, and a
    staleness manager at version 2 (eta 2) that admits a new group at the PS's version."""
    waits = ToolWaits(min_samples=4)
    waits.learn([wait_s] * 8)
    routing = ThroughputRouting(COST, 0.5, fresh=True, waits=waits)
    return routing, StalenessManager(StalenessConfig(eta=2, batch_size=4, group_size=1), 2)


def _lagging_scene(held_len: int) -> tuple[Fleet, TrajectoryPool]:
    """Two instances at version 1 (the PS is at 2), each decoding one short trajectory
    while another waits on its tool, its prefix (``held_len`` tokens on instance 0) cached
    there; the TS holds a next turn of version 0 (the oldest in flight, resumable on
    either) and a new group."""

    def lagging(inst: int, tid: int, length: int) -> InstanceSnapshot:
        run = (TrajRecord(tid, tid, 1, 2_000, 50),)
        env = (TrajRecord(tid + 1, tid + 1, 1, length, 50),)
        return InstanceSnapshot(inst, 2_000, run, (), (), 1, env, ((tid + 1, length),))

    snap = Snapshot((lagging(0, 10, held_len), lagging(1, 20, 5_000)), 10.0)
    ts = [TrajRecord(30, 0, 0, 4_000, 50), TrajRecord(40, 7, None, 100, 100)]
    return Fleet(snap), TrajectoryPool(ts)


@pytest.mark.parametrize("wait_s", [60.0, 1.0])
def test_tool_pulls_take_a_lagging_instance_when_new_groups_wait(wait_s: float) -> None:
    """Algorithm 4 keeps an instance at its version while a next turn could resume there,
    and with multi-turn work the TS always holds one: without ``tool_pulls`` no lagging
    instance is Pulled, and the new group waits for the fleet to drain. With it, a
    lagging instance whose KV in use (decoding, and the prefixes expected back soon) is
    under ``pull_kv`` is Pulled; instance 0's 60K-token prefix counts only when its tool
    answers within a turn's time (short waits), which keeps that instance at its version."""
    routing, manager = _tool_sync_setup(wait_s)
    fleet, pool = _lagging_scene(held_len=60_000)
    off = ThroughputSync(routing, pull_kv=0.5).select(fleet, pool, 2, manager.sketch())
    assert off == []
    on = ThroughputSync(routing, pull_kv=0.5, returns=True)
    kv = on.kv_in_use(fleet)
    chosen = on.select(fleet, pool, 2, manager.sketch())
    if wait_s > 10.0:  # long tools: nothing is expected back soon, both Pulls are cheap
        assert kv[0] < 0.5 * COST.kv_budget
        assert chosen == [0, 1]
    else:  # instance 0's prefix is expected back: discarding it is not cheap
        assert kv[0] > 0.5 * COST.kv_budget > kv[1]
        assert chosen == [1]


def test_tool_pulls_spare_an_instance_holding_the_oldest_trajectories() -> None:
    """A cheap Pull would interrupt what the instance decodes: never the oldest version
    in flight, which gates the trainer's next buffer. Both instances lag (version 1, the
    PS at 2) with little KV in use; only the one whose trajectory is of version 1 is
    Pulled, the one decoding a version-0 trajectory keeps its version."""

    def lagging(inst: int, v_traj: int, tid: int) -> InstanceSnapshot:
        run = (TrajRecord(tid, tid, v_traj, 2_000, 50),)
        env = (TrajRecord(tid + 1, tid + 1, 1, 5_000, 50),)  # at a long tool call
        return InstanceSnapshot(inst, 2_000, run, (), (), 1, env, ((tid + 1, 5_000),))

    routing, manager = _tool_sync_setup(60.0)
    fleet = Fleet(Snapshot((lagging(0, 0, 10), lagging(1, 1, 20)), 10.0))
    pool = TrajectoryPool([TrajRecord(30, 0, 1, 4_000, 50), TrajRecord(40, 7, None, 100, 100)])
    sync = ThroughputSync(routing, pull_kv=0.5, returns=True)
    assert sync.select(fleet, pool, 2, manager.sketch()) == [1]
    # the oldest in flight waiting in the TS instead: neither instance holds it
    fleet = Fleet(Snapshot((lagging(0, 1, 10), lagging(1, 1, 20)), 10.0))
    pool = TrajectoryPool([TrajRecord(30, 0, 0, 4_000, 50), TrajRecord(40, 7, None, 100, 100)])
    assert sync.select(fleet, pool, 2, manager.sketch()) == [0, 1]


def _next_turn_scene(busy_kv: int) -> tuple[Fleet, TrajectoryPool]:
    """A next turn whose 3,000-token prefix instance 0 caches while it decodes 20 short
    trajectories; instance 1 is empty, instance 2 decodes ``busy_kv`` tokens (all at the
    trajectory's version)."""

    def decoding(inst: int, n: int, length: int, first: int) -> tuple[TrajRecord, ...]:
        return tuple(TrajRecord(first + i, first + i, 3, length, 50) for i in range(n))

    snap = Snapshot(
        (
            InstanceSnapshot(
                0, 20_000, decoding(0, 20, 1_000, 1_000), (), (), 3, (), ((100, 3_000),)
            ),
            InstanceSnapshot(1, 0, (), (), (), 3, (), ()),
            InstanceSnapshot(
                2, busy_kv, decoding(2, busy_kv // 10_000, 10_000, 2_000), (), (), 3, (), ()
            ),
        ),
        10.0,
    )
    return Fleet(snap), TrajectoryPool([TrajRecord(100, 9, 3, 3_000, 50)])


@pytest.mark.parametrize("busy_kv", [0, 80_000])
def test_a_next_turn_stays_home_while_the_fleet_has_room(busy_kv: int) -> None:
    """``home_below``: while the fleet's mean KV in use is under that share of the budget
    the next turn stays on the instance caching its prefix, where the cost model alone
    moves it to the empty instance; once the fleet is loaded the cost model decides."""
    waits = ToolWaits(min_samples=4)
    waits.learn([1.0] * 8, [256] * 8)
    manager = StalenessManager(StalenessConfig(eta=2, batch_size=4, group_size=1), 3)

    def dest(home_below: float) -> int:
        routing = ThroughputRouting(COST, 0.5, waits=waits, locality=True, home_below=home_below)
        fleet, pool = _next_turn_scene(busy_kv)
        (placed,) = routing.route(fleet, pool, manager.sketch(), 3)
        assert placed.traj.traj_id == 100
        return placed.pos

    assert dest(0.0) == 1  # the cost model moves it: the empty instance gains more
    roomy = busy_kv == 0  # mean KV in use 6.7K of the 100K budget; 33K with the busy one
    assert dest(0.3) == (0 if roomy else 1)
