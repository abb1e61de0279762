"""Figure 15: throughput under scaled response length, batch size and number of GPUs.

One factor at a time is multiplied (``--factors``, relative to the preset: 0.5,1,2 gives the
paper's 10K/20K/40K responses, batch 64/128/256 and 64/128/256 GPUs on ``paper-6.5``);
StaleFlow and the all-vanilla baseline run at every point, and StaleFlow's throughput is
also reported relative to the baseline.

    python experiments/sim_scaling.py --preset paper-6.5 --eta 3 --steps 8 --jobs 2

Writes scaling.csv / scaling.json / scaling.png into --out.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from staleflow.sim import ClusterConfig, SimCluster, Summary, system
from staleflow.sim.report import (
    parser,
    preset,
    print_table,
    progress,
    pyplot,
    results_dir,
    run_each,
    save_figure,
    write_rows,
)
from staleflow.sim.scaling import DIMENSIONS, scale, value

SCRIPT = "sim_scaling"


def _simulate(task: tuple[str, ClusterConfig]) -> Summary:
    name, config = task
    return SimCluster(system(name, config)).run()


def main(argv: list[str] | None = None) -> int:
    p = parser(SCRIPT, __doc__, steps=8)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--factors", default="0.5,1,2", help="comma-separated, relative to the preset")
    p.add_argument("--dimensions", default=",".join(DIMENSIONS), help=f"from {DIMENSIONS}")
    p.add_argument("--systems", default="staleflow,vanilla", help="comma-separated")
    p.add_argument(
        "--jobs", type=int, default=1, help="runs in parallel processes (results do not change)"
    )
    args = p.parse_args(argv)
    out = results_dir(args.out, SCRIPT)
    factors = [float(f) for f in args.factors.split(",") if f]
    dims = [d for d in args.dimensions.split(",") if d]
    names = [s for s in args.systems.split(",") if s]

    base = preset(args.preset, eta=args.eta, steps=args.steps, seed=args.seed)
    # Factor 1 is the same cluster in every dimension: run it once per system.
    points = {(d, f) for d in dims for f in factors}
    unique = sorted({(n, "base" if f == 1 else d, f) for d, f in points for n in names})
    tasks = [
        (name, base if dim == "base" else scale(base, dim, factor)) for name, dim, factor in unique
    ]
    runs: dict[tuple[str, str, float], Summary] = {}
    labels = {id(t): f"{k[0]} {k[1]} x{k[2]:g}" for k, t in zip(unique, tasks, strict=True)}
    with progress(len(tasks), "scaling") as advance:
        results = run_each(args.jobs, _simulate, tasks, advance, lambda t: labels[id(t)])
        for point_key, (_, summary) in zip(unique, results, strict=True):
            runs[point_key] = summary

    rows: list[dict[str, Any]] = []
    for dim in dims:
        for factor in factors:
            key = "base" if factor == 1 else dim
            point = scale(base, dim, factor)
            ref = runs[names[-1], key, factor].tokens_per_s or 1.0
            for name in names:
                s = runs[name, key, factor]
                rows.append(
                    {
                        "dimension": dim,
                        "factor": factor,
                        "value": value(point, dim),
                        "system": name,
                        "tokens_per_s": s.tokens_per_s,
                        "steady_tokens_per_s": s.steady_tokens_per_s,
                        f"relative_to_{names[-1]}": s.tokens_per_s / ref,
                        "steps": s.steps,
                        "stalled": s.stalled,
                    }
                )

    cols = ["dimension", "value", "system", "tokens_per_s", "steady_tokens_per_s"]
    cols += [f"relative_to_{names[-1]}", "stalled"]
    print_table(f"Figure 15: scaling, eta={args.eta} ({args.preset})", rows, cols)
    paths = write_rows(out, "scaling", rows)
    paths.append(_plot(rows, dims, names, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


_LABELS = {"response": "response length cap", "batch": "batch size", "gpus": "GPUs"}


def _plot(rows: list[dict[str, Any]], dims: list[str], names: list[str], out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(dims), figsize=(4.5 * len(dims), 3.6), squeeze=False)
    rel = f"relative_to_{names[-1]}"
    for ax, dim in zip(axes[0], dims, strict=True):
        for name in names:
            pts = sorted(
                (r["value"], r["tokens_per_s"], r[rel])
                for r in rows
                if r["dimension"] == dim and r["system"] == name
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            if name != names[-1]:
                for x, y, g in pts:
                    ax.annotate(
                        f"{g:.2f}x",
                        (x, y),
                        textcoords="offset points",
                        xytext=(0, 6),
                        ha="center",
                        fontsize=7,
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel(_LABELS.get(dim, dim))
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize="small")
    fig.suptitle(f"Throughput under scaling (labels: relative to {names[-1]})")
    return save_figure(fig, out, "scaling")


if __name__ == "__main__":
    sys.exit(main())
