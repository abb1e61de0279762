"""The most that any rollout / training split of a workload's GPUs could train, against
what the compared systems train: whether a throughput target is within reach at all.

A split of ``G`` GPUs into ``R`` rolling out and ``G - R`` training trains at most
``min(R * rho, (G - R) * tau)`` tokens/s, ``rho`` being what a rollout GPU generates per
second and ``tau`` what a training GPU trains; the best split makes the two equal, at
``G / (1/rho + 1/tau)``. Both rates are measured on StaleFlow's own runs, after the
warm-up: ``tau`` where the trainer binds (``--trainer-bound``: its busy share near 1),
``rho`` where the rollout binds (``--rollout-bound``: the instances never idle), the best
of several such splits, as a rollout GPU generates the most with the fullest batches (the
fewer instances share the work in flight, the larger each one's batch), and in two
readings: as run (the prefill, re-prefill and Pulls of that run included) and decoding
only (every second of the rollout spent decoding: no prefill of prompts or tool
observations at all, an upper bound no engine reaches). Bound over a system's tokens/s
(over the whole run, the warm-up included) caps the ratio any system could reach against
it; a target above that cap is out of reach under the simulator's engine and trainer
models, whatever the coordinator does.

    python experiments/sim_bound.py --workload search-agent --eta 3 \
        --rollout-bound 1 2 4 8 --trainer-bound 40 --compare sticky:40 sync \
        --targets sticky:1.3 sync:2 --jobs 2 --json results/bound_search_agent.json

Each run is checked against the bound: no measured steady throughput above it (else the
rates were not the sides' best, and the script says so), and so is the rollout's rate:
still rising at the fewest rollout GPUs tried means a smaller split would show more.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from staleflow.sim import SimCluster
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.report import progress, run_each

NO_SPLIT = ("sync",)  # every GPU for both phases
IDLE_MAX = 0.05  # the rollout-bound runs' instances idle at most this share
BUSY_MIN = 0.95  # the trainer-bound run's trainer busy at least this share (steady)
PLATEAU = 0.05  # the rollout rate at the fewest GPUs tried within this of the next


class Run(NamedTuple):
    """One simulated run (the workload's shape is ``simulate``'s); picklable for --jobs."""

    role: str  # "rollout-bound", "trainer-bound" or "compare"
    system: str
    rollout_gpus: int


def simulate(run: Run, workload: str, eta: int, shape: dict[str, Any]) -> dict[str, Any]:
    """``shape``: the run's ``steps``, ``seed`` and ``small`` (Workload.system)."""
    w = WORKLOADS[workload]
    total = w.total_gpus(shape["small"])
    cfg = w.system(run.system, eta, rollout_gpus=run.rollout_gpus, **shape)
    s = SimCluster(cfg).run()
    return {
        "role": run.role,
        "system": run.system,
        "rollout_gpus": total if run.system in NO_SPLIT else run.rollout_gpus,
        "train_gpus": total if run.system in NO_SPLIT else total - run.rollout_gpus,
        "tokens_per_s": s.tokens_per_s,
        "steady_tokens_per_s": s.steady_tokens_per_s,
        "trainer_busy_steady": s.trainer_busy_steady,
        "rollout_idle": s.rollout_idle_ratio,
        "rollout_prefill": s.rollout_prefill_ratio,
        "rollout_pull": s.rollout_pull_ratio,
    }


def rollout_rates(run: dict[str, Any]) -> tuple[float, float]:
    """Tokens/s per rollout GPU of a rollout-bound run: per second busy (as run) and per
    second decoding."""
    busy = 1.0 - run["rollout_idle"]
    decoding = busy - run["rollout_prefill"] - run["rollout_pull"]
    per_gpu = run["steady_tokens_per_s"] / run["rollout_gpus"]
    return per_gpu / busy, per_gpu / decoding


def trainer_rate(run: dict[str, Any]) -> float:
    """Tokens/s per training GPU of a trainer-bound run, per second busy."""
    return float(run["steady_tokens_per_s"] / (run["train_gpus"] * run["trainer_busy_steady"]))


def bound(gpus: int, rho: float, tau: float) -> tuple[float, float]:
    """(tokens/s, rollout GPUs) of the best split of ``gpus`` at these rates."""
    return gpus / (1.0 / rho + 1.0 / tau), gpus * tau / (rho + tau)


def _split(spec: str, total: int) -> int:
    """A split as a share of the GPUs (0.25) or a count (32)."""
    try:
        value = float(spec)
    except ValueError:
        raise SystemExit(
            f"split {spec!r} is no number: use a share (0.25) or a count (32)"
        ) from None
    n = round(value * total) if value < 1.0 else int(value)
    if not 0 < n < total:
        raise SystemExit(f"split {spec!r} is no split of {total} GPUs: use a share in (0, 1)")
    return n


def _pair(spec: str, what: str) -> tuple[str, str | None]:
    name, _, value = spec.partition(":")
    if not name:
        raise SystemExit(f"{what} {spec!r}: expected NAME or NAME:VALUE")
    return name, value or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="search-agent", choices=sorted(WORKLOADS))
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="training steps per run (default eta + 8)")
    p.add_argument(
        "--rollout-bound",
        nargs="+",
        default=["1", "2", "4"],
        help="StaleFlow's splits where the rollout binds (shares of the GPUs "
        "rolling out, or counts): the best rate of them counts",
    )
    p.add_argument(
        "--trainer-bound", default="0.5", help="StaleFlow's split where the trainer binds"
    )
    p.add_argument(
        "--compare",
        nargs="*",
        default=["sticky:0.3125", "sync"],
        help="SYSTEM:SPLIT (sync: no split) runs to hold against the bound",
    )
    p.add_argument(
        "--targets",
        nargs="*",
        default=[],
        help="SYSTEM:RATIO targets (e.g. sticky:1.3 sync:2): within reach?",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="the tiny preset's scale (a smoke test of the script, not a measurement)",
    )
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload]
    total = w.total_gpus(args.small)
    steps = args.steps or args.eta + 8
    targets = {}
    for spec in args.targets:
        name, value = _pair(spec, "--targets")
        try:
            targets[name] = float(value or "")
        except ValueError:
            raise SystemExit(f"--targets {spec!r}: the ratio must be a number") from None

    def run(role: str, name: str, split: str | None) -> Run:
        return Run(role, name, total // 2 if split is None else _split(split, total))

    tasks = [run("rollout-bound", "staleflow", split) for split in args.rollout_bound]
    tasks.append(run("trainer-bound", "staleflow", args.trainer_bound))
    for spec in args.compare:
        name, split = _pair(spec, "--compare")
        if split is None and name not in NO_SPLIT:
            raise SystemExit(f"--compare {spec!r}: give {name}'s split, e.g. {name}:0.3125")
        tasks.append(run("compare", name, split))
    for name in targets.keys() - {t.system for t in tasks if t.role == "compare"}:
        raise SystemExit(f"--targets {name}: no --compare run of {name}; add --compare {name}")
    rows = []
    with progress(len(tasks), "runs") as advance:
        shape = {"steps": steps, "seed": args.seed, "small": args.small}
        fn = partial(simulate, workload=args.workload, eta=args.eta, shape=shape)
        for _, row in run_each(args.jobs, fn, tasks, advance, lambda t: t.system):
            rows.append(row)
    lows = [row for row in rows if row["role"] == "rollout-bound"]
    hi = next(row for row in rows if row["role"] == "trainer-bound")
    problems = [
        f"the rollout-bound run at {row['rollout_gpus']} GPUs idles {row['rollout_idle']:.0%} "
        "of the time: not rollout-bound; pass smaller --rollout-bound splits"
        for row in lows
        if row["rollout_idle"] > IDLE_MAX
    ]
    if hi["trainer_busy_steady"] < BUSY_MIN:
        problems.append(
            f"the trainer-bound run's trainer is busy {hi['trainer_busy_steady']:.0%}: not "
            "trainer-bound; pass a larger --trainer-bound"
        )
    measured = [rollout_rates(row) for row in lows]
    for row, (rho, rho_decoding) in zip(lows, measured, strict=True):
        row["rho_as_run"], row["rho_decoding"] = rho, rho_decoding
    by_size = sorted(lows, key=lambda row: row["rollout_gpus"])
    rising = (
        len(by_size) > 1 and by_size[0]["rho_as_run"] > (1 + PLATEAU) * by_size[1]["rho_as_run"]
    )
    if rising and by_size[0]["rollout_gpus"] > 1:
        problems.append(
            f"a rollout GPU generates {by_size[0]['rho_as_run']:,.0f} tokens/s at "
            f"{by_size[0]['rollout_gpus']} GPUs against {by_size[1]['rho_as_run']:,.0f} at "
            f"{by_size[1]['rollout_gpus']}: still rising; add a smaller --rollout-bound split"
        )
    r = {
        "rho_as_run": max(m[0] for m in measured),
        "rho_decoding": max(m[1] for m in measured),
        "tau": trainer_rate(hi),
    }
    as_run, at_as_run = bound(total, r["rho_as_run"], r["tau"])
    decoding, at_decoding = bound(total, r["rho_decoding"], r["tau"])
    print(f"{args.workload}, eta = {args.eta}, seed {args.seed}, {steps} steps, {total} GPUs")
    print(
        f"tau = {r['tau']:,.1f} tokens/s per training GPU; rho = {r['rho_as_run']:,.1f} "
        f"per rollout GPU as run, {r['rho_decoding']:,.1f} decoding only"
    )
    print(
        f"bound: {as_run:,.0f} tokens/s as run (at {at_as_run:.1f} rollout GPUs), "
        f"{decoding:,.0f} decoding only (at {at_decoding:.1f})"
    )
    print(
        f"{'run':<14} {'system':<10} {'rollout':>7} {'tokens/s':>9} {'steady':>9} "
        f"{'bound / it':>10} {'decoding / it':>13} {'idle':>5} {'prefill':>7} {'busy':>5}"
    )
    for row in rows:
        row["bound_over"] = as_run / row["tokens_per_s"]
        row["decoding_bound_over"] = decoding / row["tokens_per_s"]
        print(
            f"{row['role']:<14} {row['system']:<10} {row['rollout_gpus']:>7} "
            f"{row['tokens_per_s']:>9,.0f} {row['steady_tokens_per_s']:>9,.0f} "
            f"{row['bound_over']:>10.3f} {row['decoding_bound_over']:>13.3f} "
            f"{row['rollout_idle']:>5.3f} {row['rollout_prefill']:>7.3f} "
            f"{row['trainer_busy_steady']:>5.2f}"
        )
        if row["steady_tokens_per_s"] > decoding * 1.001:
            problems.append(
                f"{row['system']} at {row['rollout_gpus']} rollout GPUs trains "
                f"{row['steady_tokens_per_s']:,.0f} tokens/s, above the bound: the bound "
                "runs did not find the sides' best rates"
            )
    verdicts = []
    for name, ratio in targets.items():
        ref = [row for row in rows if row["role"] == "compare" and row["system"] == name]
        most, most_decoding = ref[0]["bound_over"], ref[0]["decoding_bound_over"]
        reach = (
            "within reach"
            if most >= ratio
            else ("out of reach as run" if most_decoding >= ratio else "out of reach")
        )
        verdicts.append(
            {
                "system": name,
                "target": ratio,
                "cap_as_run": most,
                "cap_decoding": most_decoding,
                "verdict": reach,
            }
        )
        print(
            f"target {ratio:g}x {name}: any system reaches at most {most:.3f}x as run, "
            f"{most_decoding:.3f}x decoding only: {reach}"
        )
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "workload": args.workload,
                    "eta": args.eta,
                    "seed": args.seed,
                    "steps": steps,
                    "gpus": total,
                    "rates": r,
                    "bound_as_run": as_run,
                    "bound_decoding": decoding,
                    "runs": rows,
                    "targets": verdicts,
                    "problems": problems,
                },
                indent=2,
            )
        )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
