"""Throughput of the trajectory server: in process, and end to end through the Ray actor.

One round moves every trajectory of a full TS through the paper's life cycle: route the
initial trajectories, interrupt them half-way (``interrupt_return``), route the partials
again (their payload now carries half a response), complete them with the full response
(one call per trajectory, as reward workers do, or batched), and hand all groups to the
trainer (``take_batch``), which refills the TS for the next round. Figures are
trajectories per second (median over rounds); ``routing_view`` is per call, each read
after a change to the queue (2048 entries), as in a coordinator cycle.

    python experiments/bench_trajectory_server.py --json results/bench_ts.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.data import ALPHABET, CharTokenizer, PromptSampler, synthetic_dataset
from staleflow.install import missing
from trajectory_server import (
    Completion,
    PartialTrajectory,
    TrajectoryServer,
    TrajectoryServerConfig,
)

OPERATIONS = (
    ("route (initial)", "trajectories/s"),
    ("interrupt_return", "trajectories/s"),
    ("route (partial)", "trajectories/s"),
    ("complete (1 per call)", "trajectories/s"),
    ("complete (batched)", "trajectories/s"),
    ("take_batch", "trajectories/s"),
    ("routing_view", "calls/s"),
)
BASELINE = ("empty Ray actor call", "calls/s")  # what any actor round trip costs here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--trajectories", type=int, default=2048, help="trajectories held (default 2048)"
    )
    p.add_argument("--group-size", type=int, default=16, help="trajectories per group (default 16)")
    p.add_argument(
        "--response-tokens", type=int, default=1000, help="tokens per response (default 1000)"
    )
    p.add_argument("--route-batch", type=int, default=16, help="trajectories per route call")
    p.add_argument("--complete-batch", type=int, default=64, help="per batched complete call")
    p.add_argument("--rounds", type=int, default=5, help="rounds per transport (default 5)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray actor")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.trajectories % args.group_size:
        p.error("--trajectories must be a multiple of --group-size")
    return args


def _response(n: int, version: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (
        rng.integers(3, 50_000, n, dtype=np.int32),
        -rng.random(n, dtype=np.float32),
        np.full(n, version, dtype=np.int32),
    )


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_round(ts: Any, args: argparse.Namespace) -> dict[str, float]:
    """One full life cycle of every trajectory; returns operations per second."""
    n, half = args.trajectories, args.response_tokens // 2
    full = _response(args.response_tokens, 0)
    part = tuple(a[:half] for a in full)
    ids = [r.traj_id for r in ts.routing_view()]
    assert len(ids) == n, f"expected {n} queued trajectories, found {len(ids)}"
    groups = sorted({r.group_id for r in ts.routing_view()})
    out: dict[str, float] = {}

    def route_all() -> None:
        for chunk in _chunks(ids, args.route_batch):
            ts.route(chunk, 0, "bench")

    out["route (initial)"] = n / _timed(route_all)

    def interrupt_all() -> None:
        for chunk in _chunks(ids, args.route_batch):
            ts.interrupt_return([PartialTrajectory(t, *part) for t in chunk])

    out["interrupt_return"] = n / _timed(interrupt_all)
    # the coordinator reads the view once per cycle, after the queue changed: route one
    # trajectory between reads (untimed) so that no call is served from a cache
    spent, probe = 0.0, ids[:50]
    for t in probe:
        ts.route([t], 0, "bench")
        spent += _timed(ts.routing_view)
    ts.interrupt_return([PartialTrajectory(t, *part) for t in probe])
    out["routing_view"] = len(probe) / spent
    out["route (partial)"] = n / _timed(route_all)

    single, batched = ids[: n // 2], ids[n // 2 :]

    def complete_single() -> None:
        for t in single:
            ts.complete(t, *full, reward=1.0, finish_reason="stop")

    def complete_batched() -> None:
        for chunk in _chunks(batched, args.complete_batch):
            ts.complete_many(
                [Completion(t, *full, reward=0.0, finish_reason="stop") for t in chunk]
            )

    out["complete (1 per call)"] = len(single) / _timed(complete_single)
    out["complete (batched)"] = len(batched) / _timed(complete_batched)
    out["take_batch"] = n / _timed(lambda: ts.take_batch(groups))
    return out


def bench(make_ts: Callable[[], Any], args: argparse.Namespace) -> dict[str, float]:
    ts = make_ts()
    run_round(ts, args)  # warm-up: allocations, imports, the actor's first calls
    rounds = [run_round(ts, args) for _ in range(args.rounds)]
    return {op: statistics.median(r[op] for r in rounds) for op, _ in OPERATIONS}


def empty_call_rate(ray: Any, calls: int = 500) -> float:
    class Echo:
        def ping(self) -> None:
            return None

    actor = ray.remote(Echo).options(num_cpus=0).remote()
    ray.get(actor.ping.remote())
    return calls / _timed(lambda: [ray.get(actor.ping.remote()) for _ in range(calls)])


def print_table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    names = list(results)
    print(
        f"trajectory server: {args.trajectories} trajectories "
        f"({args.trajectories // args.group_size} groups x {args.group_size}), "
        f"{args.response_tokens}-token responses, route batch {args.route_batch}, "
        f"median of {args.rounds} rounds"
    )
    header = f"{'operation':<24}{'unit':<16}" + "".join(f"{n:>16}" for n in names)
    print(header)
    print("-" * len(header))
    rows = (
        OPERATIONS
        if not any(BASELINE[0] in r for r in results.values())
        else (*OPERATIONS, BASELINE)
    )
    for op, unit in rows:
        row = "".join(
            f"{results[n][op]:>16,.0f}" if op in results[n] else f"{'-':>16}" for n in names
        )
        print(f"{op:<24}{unit:<16}{row}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset = synthetic_dataset(CharTokenizer(ALPHABET), size=4 * args.trajectories)
    config = TrajectoryServerConfig(
        eta=1,
        batch_size=args.trajectories // args.group_size,
        group_size=args.group_size,
        capacity_groups=args.trajectories // args.group_size,
    )
    results = {
        "in-process core": bench(lambda: TrajectoryServer(config, PromptSampler(dataset)), args)
    }
    ray_note = None
    if args.no_ray:
        ray_note = "skipped (--no-ray)"
    else:
        try:
            import ray
        except ImportError:
            ray_note = f"actor part skipped: {missing('ray')}"
            print(ray_note, file=sys.stderr)
        else:
            from trajectory_server.actor import spawn_trajectory_server

            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                results["Ray actor"] = bench(
                    lambda: spawn_trajectory_server(config, PromptSampler(dataset)), args
                )
                results["Ray actor"][BASELINE[0]] = empty_call_rate(ray)
            finally:
                ray.shutdown()
    print_table(results, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "trajectory_server",
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "results": results,
            "units": dict((*OPERATIONS, BASELINE)),
            "ray": ray_note or "ok",
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
