"""Figure 17: per-instance rollout load over time, with model synchronisations marked.

Runs StaleFlow and the all-vanilla baseline on the same cluster with a
:class:`staleflow.sim.timeline.Timeline` attached, and plots the running trajectories (or
decoded tokens/s) of the first few instances; vertical lines are Pulls, tagged with the
version pulled.

    python experiments/sim_instance_load.py --preset paper-6.5 --eta 3 --steps 8 --sample-s 5

Writes instance_load.{csv,json}, syncs.{csv,json} and instance_load.png into --out.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from staleflow.sim import SimCluster, system
from staleflow.sim.report import (
    parser,
    preset,
    print_table,
    progress,
    pyplot,
    results_dir,
    save_figure,
    write_rows,
)
from staleflow.sim.timeline import Timeline

SCRIPT = "sim_instance_load"


def main(argv: list[str] | None = None) -> int:
    p = parser(SCRIPT, __doc__, steps=8)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--systems", default="staleflow,vanilla", help="comma-separated")
    p.add_argument(
        "--sample-s", type=float, default=0.0, help="load sampling interval; 0: every cycle"
    )
    p.add_argument("--plot-instances", type=int, default=4, help="instances drawn per system")
    p.add_argument("--metric", choices=("running", "tokens_per_s"), default="running")
    args = p.parse_args(argv)
    out = results_dir(args.out, SCRIPT)
    names = [s for s in args.systems.split(",") if s]

    loads: list[dict[str, Any]] = []
    syncs: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    with progress(len(names), "instance load") as advance:
        for name in names:
            advance(name)
            config = preset(args.preset, eta=args.eta, steps=args.steps, seed=args.seed)
            cluster = SimCluster(system(name, config))
            timeline = Timeline(every_s=args.sample_s).attach(cluster)
            s = cluster.run()
            loads += [{"system": name, **r} for r in timeline.sample_rows()]
            syncs += [{"system": name, **r} for r in timeline.sync_rows()]
            table.append({"system": name, "tokens_per_s": s.tokens_per_s, **_balance(timeline)})

    print_table(
        f"Figure 17: per-instance load, eta={args.eta} ({args.preset})",
        table,
        ["system", "tokens_per_s", "pulls", "mean_running", "mean_imbalance", "max_waiting"],
    )
    paths = write_rows(out, "instance_load", loads) + write_rows(out, "syncs", syncs)
    paths.append(_plot(loads, syncs, names, args.plot_instances, args.metric, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _balance(timeline: Timeline) -> dict[str, Any]:
    """Pull count, mean running trajectories per instance, and the mean over sampling
    instants of (max - min) / mean running across instances (0: perfectly balanced)."""
    by_time: dict[float, list[int]] = defaultdict(list)
    for s in timeline.samples:
        by_time[s.time].append(s.running)
    spreads = [(max(v) - min(v)) / statistics.fmean(v) for v in by_time.values() if sum(v)]
    return {
        "pulls": len(timeline.syncs),
        "mean_running": statistics.fmean(s.running for s in timeline.samples)
        if timeline.samples
        else 0.0,
        "mean_imbalance": statistics.fmean(spreads) if spreads else 0.0,
        "max_waiting": max((s.waiting for s in timeline.samples), default=0),
    }


def _plot(
    loads: list[dict[str, Any]],
    syncs: list[dict[str, Any]],
    names: list[str],
    shown: int,
    metric: str,
    out: Path,
) -> Path:
    plt = pyplot()
    instances = sorted({r["inst"] for r in loads})[:shown] or [0]
    fig, axes = plt.subplots(
        len(instances),
        len(names),
        figsize=(5 * len(names), 1.8 * len(instances)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for col, name in enumerate(names):
        for row, inst in enumerate(instances):
            ax = axes[row][col]
            pts = [r for r in loads if r["system"] == name and r["inst"] == inst]
            ax.plot([r["time"] for r in pts], [r[metric] for r in pts], lw=0.9)
            for e in syncs:
                if e["system"] == name and e["inst"] == inst:
                    ax.axvline(e["time"], color="tab:green", lw=0.8)
                    ax.annotate(
                        f"V{e['version']}",
                        (e["time"], 1.0),
                        xycoords=("data", "axes fraction"),
                        fontsize=6,
                        color="tab:green",
                        va="top",
                    )
            ax.set_ylabel(f"inst {inst}", fontsize=8)
        axes[0][col].set_title(name)
        axes[-1][col].set_xlabel("time (s)")
    fig.suptitle(f"{metric.replace('_', ' ')} per instance; green: Pull (tag: version)")
    return save_figure(fig, out, "instance_load")


if __name__ == "__main__":
    sys.exit(main())
