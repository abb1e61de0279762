"""How long a simulated run takes: the control loop's cost on the simulator's hot path.

Times ``SimCluster(<preset>).run()`` (the paper-6.5 preset at eta = 3, 8 steps by
default: what ``staleflow sim --preset paper-6.5`` runs) in fresh processes, and with
``--baseline DIR`` the same in a checkout of another revision (``git worktree add`` or
``git archive``), runs of the two interleaved so that machine load hits both alike.
Prints wall and CPU seconds (median and min over ``--repeats``) and the ratio, and checks
that both revisions produce the same summary (the simulator is deterministic)::

    git archive main | tar -x -C /tmp/base
    python experiments/bench_sim_loop.py --baseline /tmp/base --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import hashlib, json, sys, time
from staleflow.sim import PRESETS, SimCluster
config = PRESETS[sys.argv[1]](eta=int(sys.argv[2]), steps=int(sys.argv[3]), seed=int(sys.argv[4]))
wall, cpu = time.perf_counter(), time.process_time()
summary = SimCluster(config).run()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
digest = hashlib.sha1(json.dumps(summary.as_dict(), sort_keys=True, default=str).encode())
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "summary": digest.hexdigest()[:16]}))
"""


def _once(tree: Path, args: argparse.Namespace) -> dict[str, float | str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-c", _CHILD, args.preset, str(args.eta), str(args.steps)]
    out = subprocess.run(
        [*argv, str(args.seed)], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="paper-6.5")
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, default=None, help="another checkout to compare")
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = p.parse_args(argv)
    trees = {"this": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    runs: dict[str, list[dict[str, float | str]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():  # interleaved: load hits both alike
            runs[name].append(_once(tree, args))
    rows = {}
    print(f"{args.preset} eta={args.eta} steps={args.steps} seed={args.seed}, {args.repeats} runs")
    print(f"{'tree':<10} {'wall median':>12} {'wall min':>9} {'cpu median':>11} {'cpu min':>8}")
    for name, results in runs.items():
        wall = [float(r["wall_s"]) for r in results]
        cpu = [float(r["cpu_s"]) for r in results]
        rows[name] = {
            "wall_median_s": statistics.median(wall),
            "wall_min_s": min(wall),
            "cpu_median_s": statistics.median(cpu),
            "cpu_min_s": min(cpu),
            "summaries": sorted({str(r["summary"]) for r in results}),
        }
        r = rows[name]
        print(
            f"{name:<10} {r['wall_median_s']:>11.2f}s {r['wall_min_s']:>8.2f}s "
            f"{r['cpu_median_s']:>10.2f}s {r['cpu_min_s']:>7.2f}s"
        )
    if "baseline" in rows:
        ratio = rows["this"]["cpu_median_s"] / rows["baseline"]["cpu_median_s"]
        same = rows["this"]["summaries"] == rows["baseline"]["summaries"]
        print(f"cpu time this/baseline: {ratio:.3f}; same summaries: {same}")
        rows["ratio_cpu_median"] = ratio  # type: ignore[assignment]
        rows["same_summaries"] = same  # type: ignore[assignment]
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"baseline": str(args.baseline)},
                                         "rows": rows}, indent=2, default=str) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
