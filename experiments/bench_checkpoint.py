"""What a run checkpoint costs: export, atomic write, verified read and restore of the
trajectory server and the staleness manager, at a chosen size.

The TS is filled with ``--trajectories`` trajectories in groups of ``--group-size``; each
one is routed and holds ``--response-tokens`` tokens (half of them as reported progress
of routed trajectories, half as completed ones), so the checkpoint carries every token,
logprob and per-token version. Figures are medians over ``--rounds``; MB/s is the
checkpoint's size over the step's time. The write includes fsync of every file.

    python experiments/bench_checkpoint.py --json results/bench_checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.data import ALPHABET, CharTokenizer, PromptSampler, synthetic_dataset
from staleflow.recovery import RunState, read_checkpoint, write_checkpoint
from staleflow.recovery.restore import restore_run
from staleness import StalenessConfig, StalenessManager
from trajectory_server import PartialTrajectory, TrajectoryServer, TrajectoryServerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trajectories", type=int, default=2048, help="trajectories held")
    p.add_argument("--group-size", type=int, default=16, help="trajectories per group")
    p.add_argument("--response-tokens", type=int, default=1000, help="tokens per trajectory")
    p.add_argument("--rounds", type=int, default=3, help="repetitions (median reported)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[RunState, StalenessConfig, TrajectoryServerConfig]:
    groups = args.trajectories // args.group_size
    eta = 3
    batch = -(-groups // (eta + 1))
    protocol = StalenessConfig(eta, batch, args.group_size)
    ts_config = TrajectoryServerConfig(eta, batch, args.group_size, capacity_groups=groups)
    dataset = synthetic_dataset(CharTokenizer(ALPHABET), size=max(groups, 1))
    manager = StalenessManager(protocol)
    ts = TrajectoryServer(ts_config, PromptSampler(dataset))
    view = list(ts.routing_view())
    for r in view:
        manager.reserve(r.group_id, r.traj_id, 0)
    ts.route([r.traj_id for r in view], 0, "inst")
    rng = np.random.default_rng(0)
    n = args.response_tokens
    for i, r in enumerate(view):
        tokens = rng.integers(3, 50_000, n, dtype=np.int32)
        logprobs = rng.standard_normal(n).astype(np.float32)
        versions = np.zeros(n, dtype=np.int32)
        if i % 2:
            ts.report_progress([PartialTrajectory(r.traj_id, tokens, logprobs, versions)], "inst")
        else:
            ts.complete(r.traj_id, tokens, logprobs, versions, 1.0, "stop")
    state = RunState(0, 0, 0, manager.export_state(), ts.export_state(), [])
    return state, protocol, ts_config


def measure(args: argparse.Namespace) -> dict[str, Any]:
    state, protocol, ts_config = build(args)
    dataset = synthetic_dataset(
        CharTokenizer(ALPHABET), size=max(args.trajectories // args.group_size, 1)
    )
    times: dict[str, list[float]] = {"write": [], "read + verify": [], "restore": []}
    size = 0
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            run_dir = Path(tmp) / f"run{k}"
            t0 = time.perf_counter()
            folder = write_checkpoint(run_dir, state)
            t1 = time.perf_counter()
            ck = read_checkpoint(run_dir, protocol=protocol)
            t2 = time.perf_counter()
            restore_run(ck, ts_config, PromptSampler.from_state(dataset, ck.sampler))
            t3 = time.perf_counter()
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[key].append(dt)
    tokens = args.trajectories * args.response_tokens
    rows = []
    for key, values in times.items():
        median = statistics.median(values)
        rows.append({"step": key, "seconds": median, "MB/s": size / 1e6 / median})
    return {
        "trajectories": args.trajectories,
        "tokens": tokens,
        "checkpoint_bytes": size,
        "bytes_per_token": size / max(tokens, 1),
        "rows": rows,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    print(
        f"{result['trajectories']} trajectories, {result['tokens']:,} tokens, checkpoint "
        f"{result['checkpoint_bytes'] / 1e6:.1f} MB ({result['bytes_per_token']:.1f} B/token)"
    )
    print(f"{'step':<16}{'seconds':>10}{'MB/s':>10}")
    for row in result["rows"]:
        print(f"{row['step']:<16}{row['seconds']:>10.3f}{row['MB/s']:>10.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
