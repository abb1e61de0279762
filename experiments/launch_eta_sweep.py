"""Real runs (``staleflow launch``) at several staleness bounds on the same machine and
workload, in one invocation: end-to-end throughput, reward, staleness and the share of
rollout time spent in Pull / Route / Interrupt (the paper's Table 3).

    python experiments/launch_eta_sweep.py                      # eta 3 vs 0, defaults
    python experiments/launch_eta_sweep.py --etas 0 1 3 --steps 30 --json results/eta.json
    python experiments/launch_eta_sweep.py --steps 10 rollout.instances=4

Every run uses the same config apart from eta (seed included), so the ratio compares
the staleness bound alone. Runs go one after another; the machine is shared, so repeat
with ``--repeats`` and read the spread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides for every run"
    )
    p.add_argument("--config", help="YAML config file shared by every run")
    p.add_argument("--etas", type=int, nargs="+", default=[3, 0], help="staleness bounds to run")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per eta (alternating)")
    p.add_argument("--out", default="results/launch", help="run folders go here")
    p.add_argument("--json", help="write the figures to this JSON file")
    return p.parse_args(argv)


def run_one(args: argparse.Namespace, eta: int) -> dict[str, Any]:
    from staleflow.config import load_config
    from staleflow.runtime.launch import launch

    # no dashboard: its poller would add RPCs to the runs being compared
    overrides = [
        "dashboard=false",
        *args.overrides,
        f"eta={eta}",
        f"steps={args.steps}",
        f"run_dir={args.out}",
    ]
    cfg = load_config(args.config, overrides)
    print(f"-- eta={eta}: {args.steps} steps", file=sys.stderr, flush=True)
    result = launch(cfg)
    s = result.summary
    return {
        "eta": eta,
        "run_dir": str(result.run_dir),
        "tokens_per_s": s["tokens_per_s"],
        "elapsed_s": s["elapsed_s"],
        "reward_start": s["reward_start"],
        "reward_end": s["reward_end"],
        "staleness_hist": s["staleness_hist"],
        "trainer_idle_ratio": s["trainer_idle_ratio"],
        "rollout_idle_ratio": s["rollout_idle_ratio"],
        "time_share": s["time_share"],
    }


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file bars would interleave with the output
    args = parse_args(argv)
    if any(e < 0 for e in args.etas):
        print("--etas must be >= 0", file=sys.stderr)
        return 2
    runs = [run_one(args, eta) for _ in range(args.repeats) for eta in args.etas]
    table = Table(title=f"staleflow launch, {args.steps} steps per run")
    for col in (
        "eta",
        "tokens/s",
        "reward first→last",
        "trainer idle",
        "rollout idle",
        "Pull+Route+Interrupt",
        "prefill",
        "decode",
    ):
        table.add_column(col, justify="right")
    for r in runs:
        sh = r["time_share"]
        table.add_row(
            str(r["eta"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['reward_start']:.3f}→{r['reward_end']:.3f}",
            f"{r['trainer_idle_ratio']:.1%}",
            f"{r['rollout_idle_ratio']:.1%}",
            f"{sh.get('commands', 0.0):.2%}",
            f"{sh.get('prefill', 0.0):.1%}",
            f"{sh.get('decode', 0.0):.1%}",
        )
    Console(width=max(Console().width, 120)).print(table)
    by_eta: dict[int, list[float]] = {}
    for r in runs:
        by_eta.setdefault(r["eta"], []).append(r["tokens_per_s"])
    means = {eta: sum(v) / len(v) for eta, v in by_eta.items()}
    ratios = {}
    if 0 in means:
        for eta, m in sorted(means.items()):
            if eta != 0:
                ratios[eta] = m / means[0]
                print(f"throughput eta={eta} / eta=0: {ratios[eta]:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {"runs": runs, "mean_tokens_per_s": means, "ratio_vs_eta0": ratios}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
