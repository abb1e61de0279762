"""Figure 17: per-instance rollout load over time, with model synchronisations marked.

Runs StaleFlow and the all-vanilla baseline on the same cluster with a
:class:`staleflow.sim.timeline.Timeline` attached, and plots the running trajectories (or
decoded tokens/s) of the first few instances; vertical lines are Pulls, tagged with the
version pulled.

    python experiments/sim_instance_load.py --preset paper-6.5 --eta 3 --steps 8 --sample-s 5

Writes instance_load.{csv,json}, syncs.{csv,json} and instance_load.png into --out
(default results/sim_instance_load/).

Real runs: ``--runs DIR [DIR ...]`` draws the figure from run folders written by
``staleflow launch`` instead of simulating (one column per run; the simulation options
are then ignored)::

    staleflow launch --eta 3 --steps 20
    python experiments/sim_instance_load.py --runs runs/20250101-120000-eta3

What differs: a run folder has one record per training step, so the load is per step,
not per coordinator cycle. ``instance_load`` rows are ``run, system, step, time, inst,
version, busy_ratio`` (the share of the step the instance had something to generate,
from the cumulative ``rollout/idle_ratio/<i>``; there are no running / waiting / KV
counts), and ``syncs`` rows (``run, system, step, time, inst, version``) date a Pull by
the end of the step whose record first shows the new ``rollout/version/<i>``. The table
reports ``pulls``, ``mean_busy``, ``min_busy`` and ``mean_imbalance`` (the mean over
steps of (max - min) / mean busy share across instances).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from staleflow.runfolder.reader import RunFolder
from staleflow.sim import SimCluster, system
from staleflow.sim.report import (
    add_runs_option,
    parser,
    preset,
    print_table,
    progress,
    pyplot,
    read_runs,
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
    add_runs_option(p, "Figure 17 (busy share per step, Pulls)")
    args = p.parse_args(argv)
    if args.runs:
        runs = read_runs(p, args.runs)
        return from_runs(runs, args.plot_instances, results_dir(args.out, SCRIPT))
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


def from_runs(runs: list[RunFolder], shown: int, out: Path) -> int:
    """Figure 17 of real runs: every instance's busy share per step and its Pulls."""
    loads: list[dict[str, Any]] = []
    syncs: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    for run in runs:
        steps = run.instance_steps()
        head = {"run": run.name, "system": run.system}
        for s in steps:
            row = {**head, "step": s.step, "time": s.time, "inst": s.inst, "version": s.version}
            loads.append({**row, "busy_ratio": s.busy_ratio})
            if s.pulled:
                syncs.append(row)
        table.append(
            {
                **head,
                "eta": run.eta,
                "steps": run.steps,
                "tokens_per_s": run.tokens_per_s,
                **_busy_balance(steps),
            }
        )
    print_table(
        "Figure 17 from run folders: per-instance busy share per training step",
        table,
        [
            *("run", "system", "eta", "steps", "tokens_per_s"),
            *("pulls", "mean_busy", "min_busy", "mean_imbalance"),
        ],
    )
    paths = write_rows(out, "instance_load", loads) + write_rows(out, "syncs", syncs)
    names = [r.name for r in runs]
    paths.append(_plot(loads, syncs, names, shown, "busy_ratio", out, key="run"))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _busy_balance(steps: list[Any]) -> dict[str, Any]:
    """Pull count, mean and lowest busy share, and the mean over steps of
    (max - min) / mean busy share across instances (0: perfectly balanced)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if s.busy_ratio is not None:
            by_step[s.step].append(s.busy_ratio)
    busy = [b for v in by_step.values() for b in v]
    spreads = [(max(v) - min(v)) / statistics.fmean(v) for v in by_step.values() if sum(v)]
    return {
        "pulls": sum(s.pulled for s in steps),
        "mean_busy": statistics.fmean(busy) if busy else None,
        "min_busy": min(busy) if busy else None,
        "mean_imbalance": statistics.fmean(spreads) if spreads else 0.0,
    }


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
    *,
    key: str = "system",
) -> Path:
    """One column per system (or run, ``key``), one row per instance; Pulls as lines."""
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
            pts = [
                r for r in loads if r[key] == name and r["inst"] == inst and r[metric] is not None
            ]
            xs, ys = [r["time"] for r in pts], [r[metric] for r in pts]
            style = "default"
            if key == "run" and pts:
                # A run folder's busy share covers the step ending at its time; the
                # first step starts when training does (time 0).
                xs, ys, style = [0.0, *xs], [ys[0], *ys], "steps-pre"
                ax.set_ylim(0.0, 1.05)
            ax.plot(xs, ys, lw=0.9, drawstyle=style)
            for e in syncs:
                if e[key] == name and e["inst"] == inst:
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
