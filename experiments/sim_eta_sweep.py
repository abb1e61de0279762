"""Sweep the staleness bound eta on the simulated cluster and compare systems (§6.2, §6.5).

Example (the paper's §6.5 cluster, a few minutes on two cores)::

    python experiments/sim_eta_sweep.py --preset paper-6.5 --steps 8 --json out.json

Prints one row per (system, eta): throughput, time, staleness histogram, idle ratios.
Writes sweep.{csv,json}, gains.{csv,json} (StaleFlow over each baseline per eta) and a
Figure-13-style eta_sweep.png into --out (default results/sim_eta_sweep/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from staleflow.sim import PRESETS, SYSTEMS, SimCluster, system
from staleflow.sim.presets import Layout
from staleflow.sim.report import progress, pyplot, results_dir, save_figure, write_rows

SCRIPT = "sim_eta_sweep"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="paper-6.5", choices=sorted(PRESETS))
    p.add_argument("--etas", default="0,1,2,3,5,10", help="comma-separated staleness bounds")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, from {SYSTEMS} or ablations like R1S0M1",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="training steps per run; 0: max(8, 2*eta + 6), so that at least eta + 5 steps "
        "follow the warm-up",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-gpus", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--train-gpus", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--max-response", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--json", type=Path, default=None, help="write every summary here")
    p.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default results/{SCRIPT}/)"
    )
    args = p.parse_args(argv)

    etas = [int(e) for e in args.etas.split(",") if e]
    names = [s for s in args.systems.split(",") if s]
    layout: Layout | None = None
    kwargs: dict[str, object] = {"seed": args.seed}
    if args.preset == "paper-6.5":
        default = Layout()
        layout = Layout(
            rollout_gpus=args.rollout_gpus or default.rollout_gpus,
            train_gpus=args.train_gpus or default.train_gpus,
        )
        kwargs["layout"] = layout
        if args.max_response:
            kwargs["max_response"] = args.max_response
    out = results_dir(args.out, SCRIPT)
    runs = [(n, e) for n in names for e in etas]
    # Systems that set their own bound (sync: 0, pipeline: 1) ignore the requested one.
    probe = 1 + max(etas, default=0)
    fixed = {
        n: system(n, PRESETS[args.preset](eta=probe, **kwargs), layout).eta != probe for n in names
    }
    done: set[tuple[str, int]] = set()
    results: list[dict[str, Any]] = []
    header = (
        f"{'system':<10} {'eta':>3} {'tok/s':>9} {'steady':>9} {'steps':>5} {'sim s':>7} {'wall s':>6} "
        f"{'roll idle':>9} {'prefill':>7} {'trn idle':>8} {'preempt':>7}  staleness"
    )
    print(header)
    with progress(len(runs), "eta sweep") as advance:
        for name, eta in runs:
            advance(f"{name} eta={eta}")
            steps = args.steps or max(8, 2 * eta + 6)
            preset = PRESETS[args.preset](eta=eta, steps=steps, **kwargs)
            config = system(name, preset, layout)
            if (name, config.eta) in done:
                continue  # a system with its own bound (sync: 0, pipeline: 1) runs once
            done.add((name, config.eta))
            started = time.perf_counter()
            s = SimCluster(config).run()
            wall = time.perf_counter() - started
            results.append({**s.as_dict(), "wall_s": wall, "fixed_eta": fixed[name]})
            print(
                f"{name:<10} {s.eta:>3} {s.tokens_per_s:>9.0f} {s.steady_tokens_per_s:>9.0f} "
                f"{s.steps:>5} {s.seconds:>7.0f} "
                f"{wall:>6.1f} {s.rollout_idle_ratio:>9.3f} {s.rollout_prefill_ratio:>7.3f} "
                f"{s.trainer_idle_ratio:>8.3f} {s.preemptions:>7}  {s.staleness}"
                + ("  STALLED" if s.stalled else ""),
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    table = gains(results)
    for g in table:
        print(f"staleflow over {g['baseline']} at eta={g['eta']}: {g['gain']:.2f}x")
    paths = write_rows(out, "sweep", results) + write_rows(out, "gains", table)
    if results:
        paths.append(_plot(results, table, etas, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def gains(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """StaleFlow's throughput over each baseline's at the same eta. A baseline with its own
    bound (``fixed_eta``: sync, pipeline) ran once and is compared at every eta, as VeRL
    and VeRL-Pipeline are in Figure 13."""
    ours = {r["eta"]: r["tokens_per_s"] for r in results if r["name"] == "staleflow"}
    out = []
    for eta, mine in ours.items():
        for base in dict.fromkeys(r["name"] for r in results if r["name"] != "staleflow"):
            theirs = _throughput(results, base, eta)
            if theirs:
                out.append({"eta": eta, "baseline": base, "gain": mine / theirs})
    return out


def _throughput(results: list[dict[str, Any]], name: str, eta: int) -> float | None:
    for r in results:
        if r["name"] == name and (r["eta"] == eta or r["fixed_eta"]):
            return float(r["tokens_per_s"])
    return None


def _plot(
    results: list[dict[str, Any]], table: list[dict[str, Any]], etas: list[int], out: Path
) -> Path:
    plt = pyplot()
    names = list(dict.fromkeys(r["name"] for r in results))
    gain = {(g["baseline"], g["eta"]): g["gain"] for g in table}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(etas)), 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, ys = [], []
        for j, eta in enumerate(etas):
            y = _throughput(results, name, eta)
            if y is not None:
                xs.append(j + (k - (len(names) - 1) / 2) * width)
                ys.append(y)
        bars = ax.bar(xs, ys, width, label=name)
        if name != "staleflow":
            labels = [f"({gain[name, e]:.2f}x)" if (name, e) in gain else "" for e in etas]
            if len(labels) == len(bars):
                ax.bar_label(bars, labels=labels, fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(etas)), [f"eta={e}" for e in etas])
    ax.set_ylabel("tokens/s")
    ax.set_title(
        "Throughput vs staleness bound\n(x): StaleFlow's gain over that baseline", fontsize=10
    )
    ax.legend(fontsize="small")
    return save_figure(fig, out, "eta_sweep")


if __name__ == "__main__":
    sys.exit(main())
