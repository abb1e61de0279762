"""Decision time of one coordinator cycle (Algorithm 1) at cluster scale.

Builds realistic snapshots: instances on mixed versions (some behind the PS), heavy-tailed
trajectory lengths with some instances at their KV budget and queueing, in-flight groups
Reserved in the real staleness manager, and a TS holding partial (interrupted) and
initial trajectories. Times snapshot validation (Eq. 1), the sketch and ``plan_cycle``
with the throughput-oriented strategies (or any other combination).

    python experiments/bench_coordinator.py
    python experiments/bench_coordinator.py --instances 128 512 1024 --json results/coord.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator import (
    QWEN3_30B_A3B_H20,
    Command,
    CommandDone,
    CoordinatorConfig,
    InstanceSnapshot,
    Interrupt,
    Pull,
    Route,
    Snapshot,
    SpeculativeState,
    TrajRecord,
    build_strategies,
    plan_cycle,
)
from staleness import StalenessConfig, StalenessManager

ETA, GROUP = 3, 16
VERSION = 10  # the trainer's version; the PS holds the same one


@dataclass
class Scene:
    snapshot: Snapshot
    ts: list[TrajRecord]
    manager: StalenessManager
    speculative: SpeculativeState


def build_scene(instances: int, ts_trajs: int, scenario: str, seed: int) -> Scene:
    """``steady``: mid-run load; ``cold``: idle instances and a TS of initial trajectories.

    Steady state, as in §6.5: in-flight groups fill 95% of the manager's capacity (so the
    oldest versions admit no new group); members run on instances no older than their
    group, placed on the less loaded of two random hosts; instances at the KV budget
    queue a few trajectories; a few lagging instances have drained (the ones a Pull
    helps); 10% of the TS is partial trajectories of recent groups.
    """
    rng = np.random.default_rng(seed)
    budget = int(QWEN3_30B_A3B_H20.kv_budget)
    batch = 128 * max(1, instances // 128)  # groups per step, scaled with the cluster
    m = StalenessManager(StalenessConfig(eta=ETA, batch_size=batch, group_size=GROUP), VERSION)
    ages = [VERSION, VERSION - 1, VERSION - 2, VERSION - 3]
    steady = scenario == "steady"
    versions = rng.choice(ages, instances, p=[0.6, 0.25, 0.1, 0.05]) if steady else None
    if versions is None:
        versions = np.full(instances, VERSION)
    lagging = np.flatnonzero(versions < VERSION)
    drained = set(rng.choice(lagging, min(len(lagging), instances // 20), replace=False).tolist())
    run: list[list[TrajRecord]] = [[] for _ in range(instances)]
    wait: list[list[TrajRecord]] = [[] for _ in range(instances)]
    kv = np.zeros(instances)
    partial: list[TrajRecord] = []
    next_traj = next_group = 0
    for _ in range(int(0.95 * batch * (ETA + 1)) if steady else 0):
        v = int(rng.choice(ages, p=[0.1, 0.2, 0.3, 0.4]))
        hosts = [i for i in np.flatnonzero(versions >= v).tolist() if i not in drained]
        if not m.verify(v) or not hosts:
            continue
        gid, next_group = next_group, next_group + 1
        for _ in range(GROUP):
            length = int(min(20_000, rng.lognormal(np.log(2_500), 0.9)))
            t = TrajRecord(next_traj, gid, v, length, 500)
            m.reserve(gid, next_traj, v)
            next_traj += 1
            if v >= VERSION - 1 and len(partial) < ts_trajs // 10 and rng.random() < 0.2:
                partial.append(t)
                continue
            a, b = rng.choice(hosts, 2)
            i = int(a if kv[a] <= kv[b] else b)
            if kv[i] + length <= budget and not wait[i]:
                run[i].append(t)
                kv[i] += length
            elif len(wait[i]) < 4:
                wait[i].append(t)
            else:
                partial.append(t)  # preempted and handed back earlier
    for i in drained:
        run[i] = run[i][:1]
        kv[i] = sum(t.length for t in run[i])
    snap = Snapshot(
        tuple(
            InstanceSnapshot(
                inst=i,
                kv_cache=int(kv[i]),
                run_trajs=tuple(run[i]),
                wait_trajs=tuple(wait[i]),
                complete_trajs=(),
                inst_version=int(versions[i]),
            )
            for i in range(instances)
        )
    )
    ts: list[TrajRecord] = partial[:ts_trajs]
    while len(ts) < ts_trajs:
        gid, next_group = next_group, next_group + 1
        prompt = int(rng.integers(100, 2_000))
        for _ in range(min(GROUP, ts_trajs - len(ts))):
            ts.append(TrajRecord(next_traj, gid, None, prompt, prompt))
            next_traj += 1
    spec = SpeculativeState({s.inst: s.inst_version for s in snap.instances})
    for s in snap.instances:  # as if the routes that put them there had been issued
        placed = Route(s.inst, tuple(t.traj_id for t in s.run_trajs + s.wait_trajs))
        spec.apply(placed)
        spec.settle(CommandDone(placed))
    return Scene(snap, ts, m, spec)


def time_cycle(scene: Scene, config: CoordinatorConfig, repeats: int) -> dict[str, float]:
    """Median and p90 wall time of validate + sketch + plan_cycle, and the command mix."""
    strategies = build_strategies(config)

    def cycle() -> list[Command]:
        assert scene.speculative.validate(scene.snapshot)
        return plan_cycle(scene.snapshot, scene.ts, VERSION, scene.manager.sketch(), strategies)

    cmds = cycle()  # warm-up; plan_cycle changes neither the snapshot nor the manager
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        cycle()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p90_ms": samples[int(0.9 * (len(samples) - 1))],
        "pulls": sum(isinstance(c, Pull) for c in cmds),
        "interrupted": sum(len(c.trajs) for c in cmds if isinstance(c, Interrupt)),
        "routed": sum(len(c.trajs) for c in cmds if isinstance(c, Route)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--trajectories", type=int, default=2048, help="trajectories in the TS")
    parser.add_argument(
        "--scenarios", nargs="+", default=["steady", "cold"], choices=["steady", "cold"]
    )
    parser.add_argument(
        "--strategies",
        default="throughput,throughput,throughput",
        help="routing,synchronization,migration: each 'throughput' or 'vanilla'",
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    routing, sync, migration = args.strategies.split(",")
    config = CoordinatorConfig(routing=routing, synchronization=sync, migration=migration)
    rows: list[dict[str, object]] = []
    for scenario in args.scenarios:
        for n in args.instances:
            scene = build_scene(n, args.trajectories, scenario, args.seed)
            rows.append(
                {"scenario": scenario, "instances": n, "ts_trajectories": len(scene.ts)}
                | time_cycle(scene, config, args.repeats)
            )
    print(f"strategies (routing, sync, migration) = {args.strategies}")
    print(
        f"{'scenario':<8} {'inst':>5} {'TS':>5} {'median ms':>10} {'p90 ms':>8} "
        f"{'pulls':>6} {'interrupted':>11} {'routed':>7}"
    )
    for r in rows:
        print(
            f"{r['scenario']:<8} {r['instances']:>5} {r['ts_trajectories']:>5} "
            f"{r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['pulls']:>6} "
            f"{r['interrupted']:>11} {r['routed']:>7}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"strategies": args.strategies, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
