"""Figure 16: the eight routing / synchronisation / migration combinations at one eta.

Each combination ``R?S?M?`` (1: StaleFlow's throughput-oriented strategy, 0: the vanilla
one) runs on the same simulated cluster; throughput is normalised to all-vanilla (R0S0M0).

    python experiments/sim_ablation.py --preset paper-6.5 --eta 3 --steps 8

Writes ablation.csv / ablation.json / ablation.png into --out.
"""

from __future__ import annotations

import itertools
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

SCRIPT = "sim_ablation"
COMBOS = [f"R{r}S{s}M{m}" for r, s, m in itertools.product("01", repeat=3)]


def main(argv: list[str] | None = None) -> int:
    p = parser(SCRIPT, __doc__, steps=8)
    p.add_argument("--eta", type=int, default=3)
    args = p.parse_args(argv)
    out = results_dir(args.out, SCRIPT)

    rows: list[dict[str, Any]] = []
    with progress(len(COMBOS), "ablation") as advance:
        for name in COMBOS:
            advance(name)
            config = preset(args.preset, eta=args.eta, steps=args.steps, seed=args.seed)
            s = SimCluster(system(name, config)).run()
            rows.append(
                {
                    "system": name,
                    "routing": name[1],
                    "sync": name[3],
                    "migration": name[5],
                    "eta": s.eta,
                    "steps": s.steps,
                    "tokens_per_s": s.tokens_per_s,
                    "steady_tokens_per_s": s.steady_tokens_per_s,
                    "preemptions": s.preemptions,
                    "commands": s.commands,
                    "stalled": s.stalled,
                }
            )
    base = rows[0]["tokens_per_s"] or 1.0  # R0S0M0 comes first
    for row in rows:
        row["normalised"] = row["tokens_per_s"] / base

    cols = ["system", "tokens_per_s", "steady_tokens_per_s", "normalised", "preemptions", "stalled"]
    print_table(f"Figure 16: ablation at eta={args.eta} ({args.preset})", rows, cols)
    paths = write_rows(out, "ablation", rows)
    paths.append(_plot(rows, args.eta, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _plot(rows: list[dict[str, Any]], eta: int, out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    bars = ax.bar(xs, [r["normalised"] for r in rows], color="tab:blue")
    ax.bar_label(bars, fmt="%.2f")
    marks = {"1": "\u2713", "0": "\u00d7"}  # check mark / cross, as in Figure 16
    labels = [f"R{marks[r['routing']]} S{marks[r['sync']]} M{marks[r['migration']]}" for r in rows]
    ax.set_xticks(list(xs), labels)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("throughput / all-vanilla")
    ax.set_title(f"Ablation of rollout coordination strategies (eta={eta})")
    return save_figure(fig, out, "ablation")


if __name__ == "__main__":
    sys.exit(main())
