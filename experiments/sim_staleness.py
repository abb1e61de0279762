"""Figure 18: the staleness distribution (V_buf - V_traj) of every consumed buffer.

One run of a system (StaleFlow by default) at a given eta; for each training step, how many
groups of its batch have each staleness 0..eta. The protocol guarantees none above eta.

    python experiments/sim_staleness.py --preset paper-6.5 --eta 3 --steps 16

Writes staleness.csv / staleness.json / staleness.png into --out.
"""

from __future__ import annotations

import sys
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
from staleflow.sim.summary import staleness_per_buffer

SCRIPT = "sim_staleness"


def main(argv: list[str] | None = None) -> int:
    p = parser(SCRIPT, __doc__, steps=16)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--system", default="staleflow", help="staleflow, vanilla or e.g. R1S0M1")
    args = p.parse_args(argv)
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
    paths.append(_plot(rows, width, config.eta, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _plot(rows: list[dict[str, Any]], width: int, eta: int, out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * len(rows)), 4))
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for k in range(width + 1):
        share = [r[f"staleness_{k}"] / max(1, r["groups"]) for r in rows]
        ax.bar(steps, share, bottom=bottom, label=f"staleness {k}")
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_xlabel("training step (staleness buffer)")
    ax.set_ylabel("share of groups")
    ax.set_title(f"Staleness per buffer (eta={eta})")
    ax.legend(fontsize="small", ncol=width + 1, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return save_figure(fig, out, "staleness")


if __name__ == "__main__":
    sys.exit(main())
