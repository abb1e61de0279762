"""Properties of one cycle (Algorithm 1) over random snapshots and TS contents, against the
real staleness manager:

- applying the issued Routes to the manager never violates eta: every Reserve succeeds
  and the manager's invariants hold afterwards;
- within a cycle no trajectory is routed twice or lost, and a trajectory interrupted and
  re-routed counts once;
- Algorithm 2 holds for every route, and only instances with a free KV budget and no
  queue receive throughput-oriented routes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import (
    Abort,
    Command,
    InstanceSnapshot,
    Interrupt,
    Pull,
    Route,
    Snapshot,
    TrajRecord,
    plan_cycle,
)
from staleness import StalenessConfig, StalenessManager
from tests.coordinator.builders import COST, strategies

NAMES = ("throughput", "vanilla")
ROUTING_NAMES = (*NAMES, "sticky")
# The rules beyond the paper, all on (the config defaults), for worlds drawn with rules=True.
RULES_ON = {
    "estimation": True,
    "fill_steps": 100,
    "fresh_admission": True,
    "whole_groups": True,
    "improving_moves": True,
    "critical_speedup": 1.2,
    "pull_kv": 0.25,
}


@dataclass
class World:
    manager: StalenessManager
    snapshot: Snapshot
    ts: list[TrajRecord]
    ps_version: int
    combo: tuple[str, str, str]
    rules: bool = False
    speeds: tuple[float, ...] = ()


@st.composite
def worlds(draw: st.DrawFn) -> World:
    eta = draw(st.integers(0, 3))
    G = draw(st.integers(1, 3))
    version = draw(st.integers(0, 6))
    m = StalenessManager(
        StalenessConfig(eta=eta, batch_size=draw(st.integers(1, 4)), group_size=G), version
    )
    ps = draw(st.integers(max(0, version - 1), version))
    versions = [draw(st.integers(max(0, ps - eta - 1), ps)) for _ in range(draw(st.integers(1, 6)))]
    run: list[list[TrajRecord]] = [[] for _ in versions]
    wait: list[list[TrajRecord]] = [[] for _ in versions]
    ts: list[TrajRecord] = []
    tid = itertools.count()
    for gid in range(draw(st.integers(0, 10))):
        started = draw(st.integers(0, G))  # members already reserved (in flight)
        v_group = draw(st.integers(max(0, version - eta), version))
        for k in range(G):
            if k >= started or not m.verify(v_group, gid):
                ts.append(TrajRecord(next(tid), gid, None, 80, 80))
                continue
            t = TrajRecord(next(tid), gid, v_group, draw(st.sampled_from([80, 2_000, 30_000])), 80)
            m.reserve(gid, t.traj_id, v_group)
            hosts = [i for i, v in enumerate(versions) if v >= v_group]
            where = draw(st.sampled_from(["ts", "run", "wait"])) if hosts else "ts"
            if where == "ts":
                ts.append(t)
            else:
                i = draw(st.sampled_from(hosts))
                (run if where == "run" else wait)[i].append(t)
    ts = draw(st.permutations(ts))
    insts = tuple(
        InstanceSnapshot(
            inst=i,
            kv_cache=min(sum(t.length for t in run[i]), int(COST.kv_budget)),
            run_trajs=tuple(run[i]),
            wait_trajs=tuple(wait[i]),
            complete_trajs=(),
            inst_version=v,
        )
        for i, v in enumerate(versions)
    )
    combo = (
        draw(st.sampled_from(ROUTING_NAMES)),
        *(draw(st.sampled_from(NAMES)) for _ in range(2)),
    )
    rules = draw(st.booleans())
    speeds = tuple(draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in versions)
    return World(m, Snapshot(insts), ts, ps, combo, rules, speeds)  # type: ignore[arg-type]


def cycle(w: World) -> list[Command]:
    routing, sync, migration = w.combo
    rules = RULES_ON if w.rules else {}
    strat = strategies(routing=routing, synchronization=sync, migration=migration, **rules)
    if strat.estimator is not None:  # instances of unequal, known speeds
        for s, f in zip(w.snapshot.instances, w.speeds, strict=True):
            strat.estimator.set_factor(s.inst, f)
    return plan_cycle(w.snapshot, w.ts, w.ps_version, w.manager.sketch(), strat)


def routes(commands: list[Command]) -> Iterator[Route]:
    return (c for c in commands if isinstance(c, Route))


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_routes_never_make_the_manager_violate_eta(w: World) -> None:
    commands = cycle(w)
    for route in routes(commands):
        for r in route.reservations:
            w.manager.reserve(r.group_id, r.traj_id, r.v_traj)  # raises on a violation
    restored = StalenessManager.restore(w.manager.export_state())  # validates the layout
    view = restored.view()
    for buf in view.buffers:
        assert len(buf.entries) <= buf.capacity
        for entry in buf.entries:
            assert entry.version <= buf.version <= entry.version + view.eta


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_no_trajectory_is_routed_twice_or_lost(w: World) -> None:
    commands = cycle(w)
    on_inst = {t.traj_id: s.inst for s in w.snapshot.instances for t in s.run_trajs + s.wait_trajs}
    in_ts = {t.traj_id for t in w.ts}
    interrupted: list[int] = []
    for c in commands:
        if isinstance(c, Interrupt | Abort):
            assert all(on_inst[t] == c.inst for t in c.trajs)  # taken from where it is
            interrupted += c.trajs
    assert len(interrupted) == len(set(interrupted))
    routed = [t for r in routes(commands) for t in r.trajs]
    assert len(routed) == len(set(routed))
    # Routed = waiting in the TS, or returned to it by this cycle's Interrupts.
    assert set(routed) <= in_ts | set(interrupted)


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_every_route_respects_algorithm2_and_the_instance_state(w: World) -> None:
    commands = cycle(w)
    version = {s.inst: s.inst_version for s in w.snapshot.instances}
    for c in commands:
        if isinstance(c, Pull):
            assert c.version == w.ps_version
            version[c.inst] = c.version
    all_trajs = {t.traj_id: t for t in w.ts}
    all_trajs |= {t.traj_id: t for s in w.snapshot.instances for t in s.run_trajs + s.wait_trajs}
    emptied = {c.inst for c in commands if isinstance(c, Interrupt | Pull)}
    for route in routes(commands):
        reserved = {r.traj_id: r for r in route.reservations}
        for tid in route.trajs:
            t = all_trajs[tid]
            if t.v_traj is None:  # initial: V_traj = the instance's version
                assert reserved[tid].v_traj == version[route.inst]
                assert reserved[tid].group_id == t.group_id
            else:  # partial: never to an older instance, never Reserved again
                assert tid not in reserved
                assert version[route.inst] >= t.v_traj
        if w.combo[0] == "throughput" and route.inst not in emptied:
            s = next(s for s in w.snapshot.instances if s.inst == route.inst)
            assert not s.wait_trajs
            assert s.kv_cache + sum(all_trajs[t].length for t in route.trajs) <= COST.kv_budget
