"""experiments/bench_coordinator.py: its scenes are what they claim, and it writes its
figures."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from coordinator import CoordinatorConfig, build_strategies
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from tests.support.experiments import load


def _bench() -> ModuleType:
    return load("bench_coordinator")


def _oldest_per_instance(bench: ModuleType, scene: Any) -> float:
    oldest = bench.VERSION - bench.ETA
    on = [t for s in scene.snapshot.instances for t in s.run_trajs + s.wait_trajs]
    count = sum(t.v_traj == oldest for t in on) + sum(t.v_traj == oldest for t in scene.ts)
    return count / len(scene.snapshot.instances)


def test_the_tail_scene_is_inside_the_critical_tail_and_the_rule_acts_there(
    tmp_path: Path,
) -> None:
    bench = _bench()
    tail, steady = (bench.build_scene(128, 1024, s, 0) for s in ("tail", "steady"))
    limit = CoordinatorConfig().critical_tail
    assert _oldest_per_instance(bench, tail) <= limit < _oldest_per_instance(bench, steady)
    rule = build_strategies(CoordinatorConfig()).critical
    assert rule is not None
    fleet = Fleet(tail.snapshot)
    assert rule.select(fleet, TrajectoryPool(tail.ts), bench.VERSION)  # it moves some
    out = tmp_path / "bench.json"
    args = ["--sizes", "128:1024", "--scenarios", "tail", "--repeats", "3", "--json", str(out)]
    assert bench.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["scenario"] == "tail" and row["median_cpu_ms"] > 0


def test_the_agentic_scene_has_a_third_of_its_trajectories_at_their_tools(
    tmp_path: Path,
) -> None:
    bench = _bench()
    scene = bench.build_scene(64, 1024, "agentic", 0)
    insts = scene.snapshot.instances
    tools = sum(len(s.env_trajs) for s in insts)
    on = sum(len(s.run_trajs) + len(s.wait_trajs) for s in insts)
    assert 0.28 < tools / (tools + on + len(scene.ts)) < 0.38
    # every waiting trajectory's prefix is cached where it waits; some TS partials have one
    held = {t: s.inst for s in insts for t, _ in s.held}
    assert all(held.get(t.traj_id) == s.inst for s in insts for t in s.env_trajs)
    assert any(t.traj_id in held for t in scene.ts)
    out = tmp_path / "bench.json"
    args = ["--sizes", "64:1024", "--scenarios", "agentic", "--repeats", "3", "--json", str(out)]
    assert bench.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["scenario"] == "agentic" and row["waiting_on_tools"] == tools
    assert row["routed"] > 0


def test_the_settled_scene_carries_out_the_storm_and_loses_no_trajectory(
    tmp_path: Path,
) -> None:
    """``settled``: the agentic scene after its first cycle's commands. Every trajectory
    is still there once (on an instance, at its tool or in the TS), the Pulled instances
    are at the PS's version, what was routed left the TS, and the next cycle has no storm
    left to decide."""
    bench = _bench()
    storm = bench.build_scene(64, 1024, "agentic", 0)
    config = CoordinatorConfig(
        routing="throughput", synchronization="throughput", migration="throughput"
    )

    def everyone(scene: Any) -> list[int]:
        insts = scene.snapshot.instances
        on = [t.traj_id for s in insts for t in s.run_trajs + s.wait_trajs + s.env_trajs]
        return sorted(on + [t.traj_id for t in scene.ts])

    before = everyone(storm)
    lagging = sum(s.inst_version < bench.VERSION for s in storm.snapshot.instances)
    settled = bench.settle(storm, config)
    assert everyone(settled) == before  # each exactly once

    # the routes were carried out: trajectories sit on instances they were not on, some
    # of them taken from the TS (the TS's size may move either way: the storm's
    # Interrupts fill it, its Routes empty it)
    def placed(scene: Any) -> dict[int, int]:
        insts = scene.snapshot.instances
        return {t.traj_id: s.inst for s in insts for t in s.run_trajs + s.wait_trajs}

    before_at = placed(storm)
    assert any(before_at.get(tid) != inst for tid, inst in placed(settled).items())
    in_ts = {t.traj_id for t in storm.ts}
    assert any(tid in in_ts for tid in placed(settled))
    now_lagging = sum(s.inst_version < bench.VERSION for s in settled.snapshot.instances)
    assert now_lagging < lagging  # the storm's Pulls were carried out
    assert settled.speculative.validate(bench.later(settled.snapshot, 1))
    out = tmp_path / "bench.json"
    args = ["--sizes", "64:1024", "--scenarios", "agentic", "settled", "--repeats", "3"]
    assert bench.main([*args, "--json", str(out)]) == 0
    rows = {r["scenario"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["agentic"]["pulls"] > 0 and rows["settled"]["pulls"] == 0
    assert rows["settled"]["interrupted"] < rows["agentic"]["interrupted"]
