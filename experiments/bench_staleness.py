"""Throughput of the staleness protocol: Reserve + Occupy + Consume operations per second.

Drives one StalenessManager through a steady-state workload: instances at mixed policy
versions start groups whenever ``verify`` admits them, trajectories finish in a shuffled
order, and the trainer consumes every Ready buffer. Every primitive call counts as one
operation (a Reserve per trajectory routed, an Occupy/complete per trajectory finished, a
Consume per batch); ``verify`` calls are timed too but reported apart.

    python experiments/bench_staleness.py [--batches 40] [--json results/staleness.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from staleness import StalenessConfig, StalenessManager


def run(eta: int, batch_size: int, group_size: int, batches: int, seed: int) -> dict:
    rng = random.Random(seed)
    m = StalenessManager(StalenessConfig(eta=eta, batch_size=batch_size, group_size=group_size))
    # Precompute the workload's random choices so that only the protocol is timed.
    lags = [rng.choice((0, 0, 0, 1, 1, 2)) for _ in range(1 << 16)]
    picks = [rng.random() for _ in range(1 << 16)]
    running: list[tuple[int, int]] = []
    next_gid = 0
    ops = verifies = consumed = step = 0
    t0 = time.perf_counter()
    while consumed < batches:
        step += 1
        v = max(0, m.version - min(lags[step & 0xFFFF], eta))
        verifies += 1
        if m.verify(v):
            gid = next_gid
            next_gid += 1
            base = gid * group_size
            for t in range(group_size):
                m.reserve(gid, base + t, v)
                running.append((gid, base + t))
            ops += group_size
        # Finish a few trajectories, picked out of order (long tails finish late).
        for _ in range(group_size if running else 0):
            i = int(picks[(step * 7 + len(running)) & 0xFFFF] * len(running))
            running[i], running[-1] = running[-1], running[i]
            gid, tid = running.pop()
            out = m.complete(gid, tid)
            ops += 1
            if out.ready:
                while m.is_ready():
                    m.consume()
                    ops += 1
                    consumed += 1
            if not running:
                break
    elapsed = time.perf_counter() - t0
    return {
        "eta": eta,
        "batch_size": batch_size,
        "group_size": group_size,
        "batches": consumed,
        "ops": ops,
        "verify_calls": verifies,
        "seconds": elapsed,
        "ops_per_s": ops / elapsed,
        "ops_incl_verify_per_s": (ops + verifies) / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--etas", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--batches", type=int, default=40, help="batches consumed per eta")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    rows = [
        run(eta, args.batch_size, args.group_size, args.batches, args.seed) for eta in args.etas
    ]
    # Group-level primitives alone (group size 1), the coordinator's worst case per group.
    rows += [run(eta, args.batch_size, 1, args.batches, args.seed) for eta in args.etas]
    print(f"{'eta':>4} {'G':>3} {'batches':>8} {'ops':>10} {'ops/s':>12} {'(+verify)/s':>12}")
    for r in rows:
        print(
            f"{r['eta']:>4} {r['group_size']:>3} {r['batches']:>8} {r['ops']:>10} "
            f"{r['ops_per_s']:>12,.0f} {r['ops_incl_verify_per_s']:>12,.0f}"
        )
    target = 200_000
    worst = min(r["ops_per_s"] for r in rows if r["group_size"] == args.group_size)
    print(
        f"slowest at group size {args.group_size}: {worst:,.0f} ops/s (target >= {target:,}); "
        "rows with G=1 count every group primitive separately and are for reference"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"benchmark": "staleness", "target_ops_per_s": target, "rows": rows}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
