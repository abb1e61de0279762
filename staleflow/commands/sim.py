"""``staleflow sim``: one simulated job and its summary."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from staleflow.sim import PRESETS, SimCluster, system
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.summary import decision_figures


def run(args: argparse.Namespace) -> int:
    name = args.workload or args.preset
    try:
        if args.workload:  # a matrix workload (agentic ones included) on its own cluster
            if args.workload not in WORKLOADS:
                raise ValueError(
                    f"--workload {args.workload!r} is not one of the matrix's workloads: "
                    f"use one of {', '.join(sorted(WORKLOADS))}"
                )
            workload = WORKLOADS[args.workload]
            if args.gpus is not None:
                if args.gpus < 2:
                    raise ValueError(
                        f"--gpus {args.gpus}: a cluster needs at least 2 GPUs (rollout "
                        "and training), e.g. --gpus 256"
                    )
                workload = replace(workload, gpus=args.gpus)
            cluster = workload.config(
                args.eta,
                steps=args.steps,
                seed=args.seed,
                rollout_gpus=args.rollout_gpus,
                small=args.small,
            )
        elif args.rollout_gpus is not None or args.small or args.gpus is not None:
            raise ValueError("--rollout-gpus, --gpus and --small go with --workload, not --preset")
        else:
            cluster = PRESETS[args.preset](eta=args.eta, steps=args.steps, seed=args.seed)
        config = system(args.system, cluster)
    except ValueError as exc:
        print(f"staleflow sim: {exc}", file=sys.stderr)
        return 2
    cluster_run = SimCluster(config)
    summary = cluster_run.run()
    decided = decision_figures(cluster_run.decisions)
    table = Table(title=f"simulated {args.system} on {name}, eta={args.eta}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("training steps", f"{summary.steps}" + (" (stalled)" if summary.stalled else "")),
        ("virtual time", f"{summary.elapsed_s:,.0f} s"),
        ("throughput", f"{summary.tokens_per_s:,.0f} tokens/s"),
        ("throughput after warm-up", f"{summary.steady_tokens_per_s:,.0f} tokens/s"),
        (
            "rollout idle / prefill / pull",
            f"{summary.rollout_idle_ratio:.3f} / "
            f"{summary.rollout_prefill_ratio:.3f} / {summary.rollout_pull_ratio:.3f}",
        ),
        ("trainer idle", f"{summary.trainer_idle_ratio:.3f}"),
        (
            "staleness (V_buf - V_traj: groups)",
            " ".join(f"{k}:{v}" for k, v in sorted(summary.staleness.items())),
        ),
    ]
    if decided:  # measured CPU time: in the table, not in the (deterministic) JSON
        rows.append(
            (
                "coordinator decision, CPU ms",
                f"median {decided['decision_ms_median']:.2f}, p90 {decided['decision_ms_p90']:.2f}, "
                f"max {decided['decision_ms_max']:.2f} ({decided['decisions']:,.0f} cycles)",
            )
        )
        rows.append(
            (
                "a decision's scene (mean)",
                f"{decided['decision_instances']:.0f} instances, "
                f"{decided['decision_on_instances']:,.0f} trajectories on them, "
                f"{decided['decision_waiting_on_tools']:,.0f} at tools, "
                f"{decided['decision_routable']:,.0f} routable in the TS",
            )
        )
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary.as_dict(), f, indent=2)
    return 0
