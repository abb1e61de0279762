"""Benchmarks of the parameter server (paper App. A.1 / A.3).

(a) Pull: a PS worker process holds one version of an N MiB parameter set; a
    separate reader process Pulls it over each transport into its own buffer.
    Reported as GB/s and as a fraction of a plain in-process ``np.copyto`` of
    the same bytes, measured in the same reader process in the same run.
(b) Push overlap: a trainer Pushes each new version in the background while a
    simulated training step runs; we report the time the step loses to the
    Push (step wall time with the Push minus without it) against the Push's
    own duration.
(c) Cross-node (``--cross-node``), the deployment of App. A.1 on a Ray cluster: a PS
    replica on a rollout node; a trainer on another node Pushes to it over NIXL and
    over TCP (never shared memory: the route is chosen by Ray node, as ``launch`` does);
    an instance on the replica's node Pulls over shared memory. Without ``--address``
    it starts a Ray cluster of three raylets on this machine (so "across nodes" is
    loopback here: the row shows each transport's own cost, not a network's); with
    ``--address`` it uses the nodes that advertise ``staleflow_rollout`` and
    ``staleflow_trainer`` (deploy/).

Usage:
    python experiments/bench_parameter_server.py                 # 1 GiB, all transports
    python experiments/bench_parameter_server.py --size-mib 16 --repeats 2 --json out.json
    python experiments/bench_parameter_server.py --cross-node --skip-pull --skip-push
"""

from __future__ import annotations

import os

# One BLAS thread: the simulated matmul step then occupies one core, as one
# trainer rank per core would, and leaves the other to the background Push.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from parameter_server.layout import Layout, ParamSpec
from parameter_server.push import BackgroundPusher
from parameter_server.replicas import ReplicaGroup
from parameter_server.transport import connect
from parameter_server.transport.base import Endpoint
from parameter_server.worker import PSWorker

MIB = 1 << 20
PATTERN_BYTES = MIB


def make_layout(size_mib: int) -> Layout:
    """Roughly transformer-like: equal float32 matrices of up to 16 MiB each."""
    per = min(16, size_mib)
    count = max(1, size_mib // per)
    rows = per * MIB // 4 // 1024
    return Layout([ParamSpec(f"layers.{i}.weight", (rows, 1024), "float32") for i in range(count)])


def pattern(nbytes: int) -> np.ndarray:
    block = np.random.default_rng(7).integers(0, 256, PATTERN_BYTES, dtype=np.uint8)
    reps = -(-nbytes // PATTERN_BYTES)
    return np.tile(block, reps)[:nbytes]


def prefaulted(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf[:: os.sysconf("SC_PAGE_SIZE")] = 0
    return buf


def _rates(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {
        "median_gbps": nbytes / statistics.median(seconds) / 1e9,
        "best_gbps": nbytes / min(seconds) / 1e9,
        "median_s": statistics.median(seconds),
    }


def _memcpy_times(src: np.ndarray, dst: np.ndarray, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t)
    return out


def _timed_pulls(
    puller: Any, dest: np.ndarray, repeats: int, expected: np.ndarray
) -> dict[str, Any]:
    puller.pull(dest)  # warm-up: connection set-up and one-time registration
    times = []
    for _ in range(repeats):
        dest[:: 1 << 16] = 0  # make stale bytes detectable
        start = time.perf_counter()
        puller.pull(dest)
        times.append(time.perf_counter() - start)
    full = dest.nbytes // PATTERN_BYTES * PATTERN_BYTES
    ok = bool((dest[:full].reshape(-1, PATTERN_BYTES) == expected).all())
    return {**_rates(dest.nbytes, times), "verified": ok}


def _pull_reader(
    endpoints: list[Endpoint], transports: list[str], repeats: int, results: mp.Queue
) -> None:
    """Runs in a separate process: the rollout side of a Pull."""
    report: dict[str, Any] = {}
    client = connect(endpoints[0], "shm")
    nbytes = client.layout.nbytes
    client.close()
    dest = prefaulted(nbytes)
    src = prefaulted(nbytes)
    memcpy = _memcpy_times(src, dest, repeats)
    expected = pattern(PATTERN_BYTES)
    for name in transports:
        try:
            t = connect(endpoints[0], name)
        except Exception as exc:  # reported in the table, not fatal
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        with t:
            if t.name != name:
                report[name] = {"error": f"fell back to {t.name}"}
                continue
            report[name] = _timed_pulls(t, dest, repeats, expected)
    if len(endpoints) > 1:
        replicas = {f"ps{i}": connect(ep, "shm") for i, ep in enumerate(endpoints)}
        with ReplicaGroup(replicas) as group:
            report[f"shm x{len(endpoints)}"] = _timed_pulls(group, dest, repeats, expected)
    memcpy += _memcpy_times(src, dest, repeats)
    report["memcpy"] = _rates(nbytes, memcpy)
    results.put(report)


def bench_pull(
    size_mib: int, transports: list[str], repeats: int, replicas: int = 1
) -> dict[str, Any]:
    layout = make_layout(size_mib)
    packed = pattern(layout.nbytes)
    workers = []
    try:
        for i in range(max(1, replicas)):
            nixl = i == 0 and "nixl" in transports
            workers.append(PSWorker.start(layout, num_slots=3, nixl=nixl, timeout=300))
            with connect(workers[-1].endpoint, "shm") as writer:
                writer.push(packed)
        del packed
        ctx = mp.get_context("spawn")
        results: mp.Queue = ctx.Queue()
        endpoints = [w.endpoint for w in workers]
        reader = ctx.Process(target=_pull_reader, args=(endpoints, transports, repeats, results))
        reader.start()
        report = results.get(timeout=1800)
        reader.join(60)
    finally:
        for w in workers:
            w.stop()
    memcpy = report["memcpy"]["median_gbps"]
    for row in report.values():
        if "median_gbps" in row:
            row["fraction_of_memcpy"] = row["median_gbps"] / memcpy
    return {"nbytes": layout.nbytes, **report}


def _matmul_step(seconds: float) -> Any:
    a = np.random.default_rng(0).random((256, 256))
    for _ in range(3):
        a @ a  # warm-up
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    per = max((time.perf_counter() - t) / 20, 1e-6)
    iterations = max(1, round(seconds / per))

    def step() -> None:
        for _ in range(iterations):
            a @ a  # numpy releases the GIL inside BLAS

    return step


def bench_push_overlap(
    size_mib: int, repeats: int, step_kind: str, step_ms: float | None
) -> dict[str, Any]:
    layout = make_layout(size_mib)
    weights = {n: v.copy() for n, v in layout.views(pattern(layout.nbytes)).items()}
    with PSWorker.start(layout, num_slots=3, timeout=300) as worker:
        target = connect(worker.endpoint, "shm")
        target.push(weights)  # warm-up
        push_s = []
        for _ in range(repeats):
            t = time.perf_counter()
            target.push(weights)
            push_s.append(time.perf_counter() - t)
        push_median = statistics.median(push_s)
        step_seconds = step_ms / 1e3 if step_ms else max(0.02, 2 * push_median)
        if step_kind == "sleep":

            def step() -> None:
                time.sleep(step_seconds)

        else:
            step = _matmul_step(step_seconds)
        # Alternate plain and overlapped steps so drift in machine load hits both alike.
        alone, overlapped, submit = [], [], []
        with BackgroundPusher(target) as pusher:
            for _ in range(repeats):
                t = time.perf_counter()
                step()
                alone.append(time.perf_counter() - t)
                t = time.perf_counter()
                handle = pusher.push_async(None, weights)
                submit.append(time.perf_counter() - t)
                step()
                handle.before_overwrite()  # the optimizer is about to write new weights
                overlapped.append(time.perf_counter() - t)
        target.close()
    step_alone = statistics.median(alone)
    exposed = max(0.0, statistics.median(overlapped) - step_alone)
    return {
        "nbytes": layout.nbytes,
        "step_kind": step_kind,
        "push_s": push_median,
        "step_alone_s": step_alone,
        "step_with_push_s": statistics.median(overlapped),
        "submit_s": statistics.median(submit),
        "exposed_s": exposed,
        "exposed_fraction_of_push": exposed / push_median,
    }


# -- (c) cross-node ---------------------------------------------------------------------


class _ReplicaHost:
    """A PS replica on its node, listening on the node's address (a Ray actor)."""

    def __init__(self, size_mib: int) -> None:
        import ray

        self.worker = PSWorker.start(
            make_layout(size_mib),
            num_slots=3,
            nixl=True,
            address=f"tcp:{ray.util.get_node_ip_address()}:0",
            timeout=300,
        )

    def endpoint(self) -> Endpoint:
        return self.worker.endpoint

    def stop(self) -> None:
        self.worker.stop()


class _Client:
    """A trainer (Push) or an instance (Pull) on its node (a Ray actor)."""

    def push(self, endpoint: Endpoint, transport: str, repeats: int) -> dict[str, Any]:
        from parameter_server.replicas import ReplicaRoute, connect_replica

        with connect_replica(ReplicaRoute("ps/0", endpoint, False, transport)) as t:
            packed = pattern(t.layout.nbytes)
            t.push(packed)  # warm-up: connection set-up and one-time registration
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                t.push(packed)
                times.append(time.perf_counter() - start)
            return {"transport": t.name, **_rates(packed.nbytes, times)}

    def pull(self, endpoint: Endpoint, repeats: int) -> dict[str, Any]:
        from parameter_server.replicas import ReplicaRoute, connect_replica

        with connect_replica(ReplicaRoute("ps/0", endpoint, True, "auto")) as t:
            dest = prefaulted(t.layout.nbytes)
            row = _timed_pulls(t, dest, repeats, pattern(PATTERN_BYTES))
            memcpy = _memcpy_times(prefaulted(dest.nbytes), dest, repeats)
            return {"transport": t.name, **row, "memcpy": _rates(dest.nbytes, memcpy)}


def bench_cross_node(size_mib: int, repeats: int, address: str | None) -> dict[str, Any]:
    import ray

    cluster = None
    if address is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=2, resources={"staleflow_rollout": 1})
        cluster.add_node(num_cpus=2, resources={"staleflow_trainer": 1})
        cluster.wait_for_nodes()
        address = cluster.address
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        on = {
            name: {"num_cpus": 0, "resources": {name: 0.001}}
            for name in ("staleflow_rollout", "staleflow_trainer")
        }
        host = ray.remote(_ReplicaHost).options(**on["staleflow_rollout"]).remote(size_mib)
        instance = ray.remote(_Client).options(**on["staleflow_rollout"]).remote()
        trainer = ray.remote(_Client).options(**on["staleflow_trainer"]).remote()
        endpoint = ray.get(host.endpoint.remote(), timeout=600)
        out: dict[str, Any] = {
            "nbytes": make_layout(size_mib).nbytes,
            "one_host": cluster is not None,
        }
        for transport in ("nixl", "socket"):
            out[f"push_{transport}"] = ray.get(trainer.push.remote(endpoint, transport, repeats))
        out["pull_shm"] = ray.get(instance.pull.remote(endpoint, repeats))
        ray.get(host.stop.remote())
        return out
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def print_cross_node(row: dict[str, Any]) -> None:
    where = "Ray nodes on one host: loopback" if row["one_host"] else "Ray nodes of a cluster"
    print(f"\nCross-node ({where}), {row['nbytes'] / MIB:.0f} MiB a version")
    print(f"{'':<28} {'transport':<10} {'GB/s (median)':>14} {'GB/s (best)':>12}")
    for key, what in (
        ("push_nixl", "Push to another node (NIXL)"),
        ("push_socket", "Push to another node (TCP)"),
        ("pull_shm", "Pull on the replica's node"),
    ):
        r = row[key]
        print(f"{what:<28} {r['transport']:<10} {r['median_gbps']:>14.2f} {r['best_gbps']:>12.2f}")
    memcpy = row["pull_shm"]["memcpy"]["median_gbps"]
    print(f"{'memcpy on that node':<28} {'':<10} {memcpy:>14.2f}")


def print_tables(pull: dict[str, Any] | None, pushes: list[dict[str, Any]]) -> None:
    if pull is not None:
        memcpy = pull["memcpy"]
        print(f"\nPull of {pull['nbytes'] / MIB:.0f} MiB from a PS worker into another process")
        print(f"{'transport':<10} {'GB/s (median)':>14} {'GB/s (best)':>12} {'vs memcpy':>10}")
        print(
            f"{'memcpy':<10} {memcpy['median_gbps']:>14.2f} {memcpy['best_gbps']:>12.2f} "
            f"{'100%':>10}"
        )
        for name, row in pull.items():
            if name in ("memcpy", "nbytes"):
                continue
            if "error" in row:
                print(f"{name:<10} {'unavailable: ' + row['error']}")
                continue
            flag = "" if row["verified"] else "  (CONTENT MISMATCH)"
            print(
                f"{name:<10} {row['median_gbps']:>14.2f} {row['best_gbps']:>12.2f} "
                f"{row['fraction_of_memcpy']:>10.0%}{flag}"
            )
    for push in pushes:
        print(f"\nPush overlap ({push['nbytes'] / MIB:.0f} MiB, {push['step_kind']} step)")
        print(f"  push alone          {push['push_s'] * 1e3:9.1f} ms")
        print(f"  step alone          {push['step_alone_s'] * 1e3:9.1f} ms")
        print(
            f"  step with push      {push['step_with_push_s'] * 1e3:9.1f} ms"
            f"  (push_async returned in {push['submit_s'] * 1e6:.0f} us)"
        )
        print(
            f"  exposed per step    {push['exposed_s'] * 1e3:9.2f} ms"
            f"  = {push['exposed_fraction_of_push']:.1%} of the push"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-mib",
        type=int,
        default=1024,
        help="size of the parameter set in MiB (default 1024 = 1 GiB)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per case")
    parser.add_argument(
        "--transports",
        default="shm,nixl,socket",
        help="comma-separated transports to Pull over (shm, nixl, socket)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="also Pull from this many shm replicas at once through a ReplicaGroup",
    )
    parser.add_argument(
        "--step",
        choices=("sleep", "matmul", "both"),
        default="both",
        help="simulated training step for the Push-overlap benchmark",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="training step length (default: twice the push time)",
    )
    parser.add_argument(
        "--cross-node",
        action="store_true",
        help="also (c): Push across Ray nodes (NIXL, TCP) vs Pull on the replica's node (shm)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="with --cross-node: a Ray cluster with staleflow_rollout and staleflow_trainer "
        "nodes (default: start three raylets on this machine)",
    )
    parser.add_argument("--skip-pull", action="store_true", help="skip benchmark (a)")
    parser.add_argument("--skip-push", action="store_true", help="skip benchmark (b)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    pull = None
    if not args.skip_pull:
        pull = bench_pull(args.size_mib, transports, args.repeats, args.replicas)
    kinds = ["sleep", "matmul"] if args.step == "both" else [args.step]
    pushes = (
        []
        if args.skip_push
        else [bench_push_overlap(args.size_mib, args.repeats, k, args.step_ms) for k in kinds]
    )
    cross = bench_cross_node(args.size_mib, args.repeats, args.address) if args.cross_node else None
    print_tables(pull, pushes)
    if cross is not None:
        print_cross_node(cross)
    load_after = os.getloadavg()
    print(
        f"\n{os.cpu_count()} CPUs; 1-min load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after (other work on the machine skews the figures)"
    )
    if args.json:
        result = {
            "config": vars(args) | {"json": str(args.json)},
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "pull": pull,
            "push_overlap": pushes,
            "cross_node": cross,
        }
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
