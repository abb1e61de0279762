"""Figure 18: the staleness distribution (V_buf - V_traj) of every consumed buffer.

One run of a system (StaleFlow by default) at a given eta; for each training step, how many
groups of its batch have each staleness 0..eta. The protocol guarantees none above eta.

    python experiments/sim_staleness.py --preset paper-6.5 --eta 3 --steps 16

Writes staleness.csv / staleness.json / staleness.png into --out (default
results/sim_staleness/).

Real runs: ``--runs DIR [DIR ...]`` draws the same figure from run folders written by
``staleflow launch`` (their per-step ``staleness/hist/<k>`` records) instead of
simulating; the simulation options are then ignored::

    staleflow launch --eta 3 --steps 20
    python experiments/sim_staleness.py --runs runs/20250101-120000-eta3

The rows gain a ``run`` column (the folder's name), one plot panel per run, and a real run
counts trajectories, not groups: the count column is ``trajectories`` where the simulated
rows have ``groups``.
"""

from __future__ import annotations

import sys
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
from staleflow.sim.summary import staleness_per_buffer

SCRIPT = "sim_staleness"


def main(argv: list[str] | None = None) -> int:
    p = parser(SCRIPT, __doc__, steps=16)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--system", default="staleflow", help="staleflow, vanilla or e.g. R1S0M1")
    add_runs_option(p, "Figure 18")
    args = p.parse_args(argv)
    if args.runs:
        runs = read_runs(p, args.runs)
        return from_runs(runs, results_dir(args.out, SCRIPT))
    out = results_dir(args.out, SCRIPT)

    config = system(
        args.system, preset(args.preset, eta=args.eta, steps=args.steps, seed=args.seed)
    )
    with progress(1, "staleness") as advance:
        advance(f"{args.system} eta={args.eta}")
        cluster = SimCluster(config)
        summary = cluster.run()
    width = max(config.eta, *(max(h, default=0) for _, h in staleness_per_buffer(cluster)))
    rows: list[dict[str, Any]] = []
    for step, (version, hist) in enumerate(staleness_per_buffer(cluster), start=1):
        row: dict[str, Any] = {"step": step, "buffer_version": version}
        row.update({f"staleness_{k}": hist.get(k, 0) for k in range(width + 1)})
        row["groups"] = sum(hist.values())
        row["max_staleness"] = max(hist, default=0)
        rows.append(row)

    cols = list(rows[0]) if rows else ["step"]
    print_table(
        f"Figure 18: groups per staleness, {args.system} eta={config.eta} ({args.preset}); "
        f"{summary.tokens_per_s:,.0f} tok/s",
        rows,
        cols,
    )
    paths = write_rows(out, "staleness", rows)
    paths.append(_plot([(f"eta={config.eta}", rows)], width, "groups", out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def from_runs(runs: list[RunFolder], out: Path) -> int:
    """Figure 18 of real runs: one row per run and training step."""
    width = max(
        0,
        *(r.eta or 0 for r in runs),
        *(max(h, default=0) for r in runs for _, h in r.staleness_per_step()),
    )
    rows: list[dict[str, Any]] = []
    panels = []
    for run in runs:
        mine = []
        for step, (version, hist) in enumerate(run.staleness_per_step(), start=1):
            row: dict[str, Any] = {"run": run.name, "step": step, "buffer_version": version}
            row.update({f"staleness_{k}": hist.get(k, 0) for k in range(width + 1)})
            row["trajectories"] = sum(hist.values())
            row["max_staleness"] = max(hist, default=0)
            mine.append(row)
        cols = [c for c in mine[0] if c != "run"]
        done = "" if run.finished else " (unfinished: no summary.json)"
        print_table(
            f"Figure 18: trajectories per staleness, run {run.name} eta={run.eta}; "
            f"{run.tokens_per_s:,.1f} tok/s{done}",
            mine,
            cols,
        )
        rows += mine
        panels.append((f"{run.name} (eta={run.eta})", mine))
    paths = write_rows(out, "staleness", rows)
    paths.append(_plot(panels, width, "trajectories", out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _plot(
    panels: list[tuple[str, list[dict[str, Any]]]], width: int, count: str, out: Path
) -> Path:
    """One stacked-bar panel per run: the share of each staleness in every buffer."""
    plt = pyplot()
    longest = max((len(rows) for _, rows in panels), default=0)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(6.0, 0.4 * longest), 3.2 * len(panels) + 0.8), squeeze=False
    )
    for (title, rows), (ax,) in zip(panels, axes, strict=True):
        steps = [r["step"] for r in rows]
        bottom = [0.0] * len(rows)
        for k in range(width + 1):
            share = [r[f"staleness_{k}"] / max(1, r[count]) for r in rows]
            ax.bar(steps, share, bottom=bottom, label=f"staleness {k}")
            bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        ax.set_ylabel(f"share of {count}")
        ax.set_title(f"Staleness per buffer, {title}")
    axes[-1][0].set_xlabel("training step (staleness buffer)")
    axes[-1][0].legend(
        fontsize="small", ncol=width + 1, loc="upper center", bbox_to_anchor=(0.5, -0.25)
    )
    return save_figure(fig, out, "staleness")


if __name__ == "__main__":
    sys.exit(main())
