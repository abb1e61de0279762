"""Does a launch learn as well with speculative decoding on as with it off? Real runs
(``staleflow launch``) of the same config with ``rollout.speculation.method=off`` and
``=group`` (or another method), seed by seed, in one invocation (issue 38).

    python experiments/launch_speculation.py --steps 200 --seeds 3 \
        --out runs/spec --json results/launch_speculation.json

Per run: the held-out reward at the start and the end, tokens/s, the staleness histogram
and the largest staleness, the audit (created = consumed + the rest, no trajectory
unaccounted for) and speculation's counters (drafts verified, draft tokens, accepted
ones). Then, per method, the held-out reward at the end over the seeds against off's:
speculative sampling draws from the target's distribution exactly (docs/speculation.md),
so the two must agree within the seeds' spread. The runs of one seed go one after
another (off first), so an interrupted invocation still leaves complete pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from launch_eta_sweep import sweep_row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for all")
    p.add_argument("--config", help="YAML config file shared by every run")
    p.add_argument("--eta", type=int, default=3, help="the staleness bound of every run")
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, each with every method")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["group"],
        help="speculation arms run against off: a method, or METHOD@key=value,... with "
        "rollout.speculation settings, e.g. group@max_draft=4,batch_draft_tokens=1024",
    )
    p.add_argument(
        "--baseline",
        help="take the off runs from this earlier JSON of the script (same steps, seeds and "
        "config) instead of running them again",
    )
    p.add_argument("--out", default="results/launch_speculation", help="run folders go here")
    p.add_argument("--json", help="write the figures to this JSON file")
    return p.parse_args(argv)


def arm_overrides(arm: str) -> list[str]:
    """``group`` or ``group@max_draft=4,batch_draft_tokens=1024`` as config overrides."""
    method, _, settings = arm.partition("@")
    extra = [f"rollout.speculation.{kv}" for kv in settings.split(",") if kv]
    return [f"rollout.speculation.method={method}", *extra]


def run_one(args: argparse.Namespace, method: str, seed: int) -> dict[str, Any]:
    from staleflow.config import load_config
    from staleflow.runfolder.run_summary import audit_balanced
    from staleflow.runfolder.step_record import speculation_counts
    from staleflow.runtime.driver.launch import launch

    overrides = [
        "dashboard=false",  # its poller would add RPCs to the runs being compared
        *args.overrides,
        f"eta={args.eta}",
        f"steps={args.steps}",
        f"run_dir={args.out}",
        f"seed={seed}",
        *arm_overrides(method),
    ]
    cfg = load_config(args.config, overrides)
    print(f"-- speculation={method} seed={seed}: {args.steps} steps", file=sys.stderr, flush=True)
    result = launch(cfg)
    row = sweep_row(result, args.eta, False, None, cfg.seed)
    counts = speculation_counts(result.records[-1].extra) if result.records else None
    verifications, drafted, accepted = counts or (0, 0, 0)
    s = result.summary
    return row | {
        "method": method,
        "staleness_max": s.staleness_max,
        "audit": s.audit,
        "audit_balanced": audit_balanced(s.audit),
        "verifications": verifications,
        "drafted": drafted,
        "accepted": accepted,
        "accepted_per_verification": accepted / verifications if verifications else 0.0,
    }


def compare(runs: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method: the held-out reward at the end over the seeds against off's, and
    whether its mean lies within the range of off's seeds (and off's within its)."""

    def ends(method: str) -> list[float]:
        return [r["eval_reward_end"] for r in runs if r["method"] == method]

    off = ends("off")
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        on = ends(method)
        if not off or not on or None in off or None in on:
            continue
        m_off, m_on = statistics.fmean(off), statistics.fmean(on)
        out[method] = {
            "eval_end_off": off,
            "eval_end_on": on,
            "mean_off": m_off,
            "mean_on": m_on,
            "within_spread": min(off) <= m_on <= max(off) or min(on) <= m_off <= max(on),
            "tokens_per_s_ratio": statistics.fmean(
                on_r["tokens_per_s"] / off_r["tokens_per_s"]
                for on_r in runs
                if on_r["method"] == method
                for off_r in runs
                if off_r["method"] == "off" and off_r["seed"] == on_r["seed"]
            ),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    args = parse_args(argv)
    if args.seeds < 1 or args.steps < 1:
        print("--seeds and --steps must be >= 1", file=sys.stderr)
        return 2
    if any(m.partition("@")[0] == "off" for m in args.methods):
        print("--methods lists the methods run against off; off runs anyway", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    baseline = []
    if args.baseline:
        earlier = json.loads(Path(args.baseline).read_text())["runs"]
        baseline = [r for r in earlier if r["method"] == "off" and r["seed"] < args.seeds]
        if {r["seed"] for r in baseline} != set(range(args.seeds)):
            print(f"--baseline {args.baseline} lacks an off run of some seed", file=sys.stderr)
            return 2
    for seed in range(args.seeds):
        runs += [r for r in baseline if r["seed"] == seed]
        for method in ("off", *args.methods) if not baseline else args.methods:
            runs.append(run_one(args, method, seed))
            r = runs[-1]
            print(
                f"seed={seed} speculation={method}: held-out reward "
                f"{r['eval_reward_start']} -> {r['eval_reward_end']}, "
                f"{r['tokens_per_s']:.1f} tok/s, staleness mean {r['staleness_mean']} max "
                f"{r['staleness_max']} {r['staleness_hist']}, audit "
                f"{'balanced' if r['audit_balanced'] else 'NOT balanced'}, "
                f"{r['accepted']}/{r['drafted']} draft tokens accepted in "
                f"{r['verifications']} verifications",
                flush=True,
            )
            if args.json:  # after every run: an interrupted invocation keeps what it did
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(
                    json.dumps({"runs": runs, "compare": compare(runs, args.methods)}, indent=2)
                    + "\n"
                )
    for method, c in compare(runs, args.methods).items():
        print(
            f"held-out reward at the end, off | {method}: {c['mean_off']:.3f} | "
            f"{c['mean_on']:.3f} (seeds {c['eval_end_off']} | {c['eval_end_on']}), "
            f"{'within' if c['within_spread'] else 'NOT within'} the seeds' spread; "
            f"tokens/s {method} / off {c['tokens_per_s_ratio']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
