"""Dynamic sampling on the built-in task (issue 37): real runs (``staleflow launch``) with
``trainer.dynamic_sampling`` off and on, side by side, in one invocation.

The issue's bar: with it on, the batch stays full, the trainer's idle share grows by at
most 5 points, and the dropped share is reported. Per run this prints the trainer's idle
share (its wait for a Ready buffer over the run), the batch fill (trajectories trained
per step over ``batch_size x group_size``, every step), the share of completed groups
dropped (``summary.json``'s ``filtered_frac``) with the groups dropped and those kept
past the budget, the end-of-run audit's balance, throughput and rewards; then the
verdict of each on run against the off run of the same seed and repeat::

    python experiments/bench_dynamic_sampling.py --steps 30 --json results/dynsample.json
    python experiments/bench_dynamic_sampling.py --steps 200 --repeats 2 eval_problems=512

Everything after the flags is a config override for every run (``key=value``). Runs go
one after another (off, on, off, on, ... with ``--repeats``), with the same config and
seed apart from the switch; the machine is shared, so read the spread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

IDLE_BAR = 0.05  # the issue's "grows by at most 5 points"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--config", help="YAML config file shared by every run")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--repeats", type=int, default=1, help="off/on pairs to run")
    p.add_argument("--out", default="results/dynsample", help="run folders go here")
    p.add_argument("--json", help="write the figures to this JSON file")
    return p.parse_args(argv)


def run_one(args: argparse.Namespace, on: bool, repeat: int) -> dict[str, Any]:
    from staleflow.config import load_config
    from staleflow.runfolder.run_summary import audit_balanced
    from staleflow.runfolder.step_record import FLAT_KEPT
    from staleflow.runtime.driver.launch import launch

    overrides = [
        "dashboard=false",  # its poller would add RPCs to the runs being compared
        "eval_problems=0",
        *args.overrides,
        f"steps={args.steps}",
        f"run_dir={args.out}",
        f"name=ds-{'on' if on else 'off'}-{repeat}",
        f"trainer.dynamic_sampling={str(on).lower()}",
    ]
    cfg = load_config(args.config, overrides)
    print(f"-- dynamic sampling {'on' if on else 'off'} (repeat {repeat})", file=sys.stderr)
    result = launch(cfg)
    s = result.summary
    audit = s.audit or {}
    full = cfg.batch_size * cfg.group_size
    fills = [(r.trajectories or 0) / full for r in result.records]
    return {
        "dynamic_sampling": on,
        "repeat": repeat,
        "seed": cfg.seed,
        "steps": len(result.records),
        "trainer_idle_ratio": s.trainer_idle_ratio,
        "rollout_idle_ratio": s.rollout_idle_ratio,
        "batch_fill_min": min(fills) if fills else 0.0,
        "batch_fill_mean": sum(fills) / len(fills) if fills else 0.0,
        "filtered_frac": s.filtered_frac,
        "filtered_groups": s.filtered_groups,
        "flat_kept_groups": _sum_extra(result.records, FLAT_KEPT),
        "audit": {k: v for k, v in audit.items() if k != "recovery"},
        "audit_balanced": audit_balanced(audit),
        "staleness_max": s.staleness_max,
        "eta": cfg.eta,
        "tokens_per_s": s.tokens_per_s,
        "elapsed_s": s.elapsed_s,
        "reward_start": s.reward_start,
        "reward_end": s.reward_end,
        "run_dir": str(result.run_dir),
    }


def _sum_extra(records: list[Any], key: str) -> int | None:
    values = [r.extra[key] for r in records if key in r.extra]
    return int(sum(values)) if values else None


def verdicts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each on run against the off run of the same repeat."""
    off = {r["repeat"]: r for r in runs if not r["dynamic_sampling"]}
    out = []
    for on in (r for r in runs if r["dynamic_sampling"]):
        base = off.get(on["repeat"])
        if base is None:
            continue
        growth = on["trainer_idle_ratio"] - base["trainer_idle_ratio"]
        out.append(
            {
                "repeat": on["repeat"],
                "idle_off": base["trainer_idle_ratio"],
                "idle_on": on["trainer_idle_ratio"],
                "idle_growth_points": 100 * growth,
                "idle_ok": growth <= IDLE_BAR,
                "batch_full": on["batch_fill_min"] == 1.0,
                "dropped_reported": on["filtered_frac"] is not None,
                "bound_held": on["staleness_max"] <= on["eta"],
                "audit_balanced": on["audit_balanced"],
                "tokens_per_s_ratio": on["tokens_per_s"] / base["tokens_per_s"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    args = parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        print("--steps and --repeats must be >= 1", file=sys.stderr)
        return 2
    runs = [run_one(args, on, k) for k in range(args.repeats) for on in (False, True)]
    table = Table(title=f"dynamic sampling on the built-in task, {args.steps} steps per run")
    for col in (
        "dyn. sampling",
        "repeat",
        "trainer idle",
        "rollout idle",
        "batch fill (min)",
        "dropped share",
        "groups dropped",
        "kept past budget",
        "audit",
        "tokens/s",
        "reward first→last",
    ):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(
            "on" if r["dynamic_sampling"] else "off",
            str(r["repeat"]),
            f"{r['trainer_idle_ratio']:.1%}",
            f"{r['rollout_idle_ratio']:.1%}",
            f"{r['batch_fill_min']:.3f}",
            "-" if r["filtered_frac"] is None else f"{r['filtered_frac']:.1%}",
            "-" if r["filtered_groups"] is None else str(r["filtered_groups"]),
            "-" if r["flat_kept_groups"] is None else str(r["flat_kept_groups"]),
            "balanced" if r["audit_balanced"] else "UNBALANCED",
            f"{r['tokens_per_s']:.1f}",
            f"{r['reward_start']:.3f}→{r['reward_end']:.3f}",
        )
    Console(width=max(Console().width, 120)).print(table)
    checks = verdicts(runs)
    for v in checks:
        ok = all(
            v[k]
            for k in ("idle_ok", "batch_full", "dropped_reported", "bound_held", "audit_balanced")
        )
        print(
            f"repeat {v['repeat']}: trainer idle {v['idle_off']:.1%} -> {v['idle_on']:.1%} "
            f"({v['idle_growth_points']:+.1f} points, bar +{100 * IDLE_BAR:.0f}), batch "
            f"{'full' if v['batch_full'] else 'NOT full'}, bound "
            f"{'held' if v['bound_held'] else 'BROKEN'}, audit "
            f"{'balanced' if v['audit_balanced'] else 'UNBALANCED'}, tokens/s on / off "
            f"{v['tokens_per_s_ratio']:.3f}x: {'PASS' if ok else 'FAIL'}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": runs, "verdicts": checks}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
