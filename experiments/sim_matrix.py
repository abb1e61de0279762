"""The experiment matrix of issue #17: StaleFlow against every baseline, per workload and
staleness bound, over seeds, each system on its own best rollout/training split.

    python experiments/sim_matrix.py --jobs 2 --json results/sim_matrix.json

Workloads (``staleflow.sim.presets.WORKLOADS``): the §6.5 preset at 20K and 40K, a heavier
tail, a bimodal long/short mix, persistent instance speeds at sigma 0.1 and 0.2, a
within-group outlier mix, 512 GPUs. Systems: ``staleflow``; the in-flight-limited
baselines ``sticky`` (fixed assignment, as VeRL-Async / AReaL / ROLL Flash run it) and
``vanilla`` (§6.5's all-vanilla combination, which re-spreads everything at each
version); ``pipeline`` (eta = 1) and ``sync`` (eta = 0), which run once per seed and are
compared at every eta, as in Figure 13.

Two phases. (1) The split search (§6.1 tunes "the GPU allocation ratio between rollout
and training to optimal values"): every system that has a split runs each ``--splits``
fraction of the GPUs as rollout on the first seed (``--search-seeds N``: on the first N,
keeping the best mean), at every eta of the matrix, and keeps its best per workload and
eta: which side binds moves with eta (at eta = 1 the rollout side, at eta >= 3 often the
trainer), so a split chosen at one eta starves the other side at another. ``--split-eta
N`` searches at N only and keeps that split for every eta (half the search's runs).
``sync`` uses every GPU for both phases. (2) Every cell runs every
seed at the chosen splits; runs of phase 1 are reused where they coincide.

Every run is audited independently of the staleness manager (``staleflow.sim.audit``):
the trainer's version at consumption minus each trajectory's first-token version, the
token versions being the engines' own. Per cell the script prints StaleFlow / each
baseline (mean +- std [min..max] over seeds), the largest audited staleness, the
binding resource (the trainer's busy share after the warm-up: ~1 means trainer-bound)
and, at the end, one verdict line per requirement of the issue.

Writes matrix_runs.{csv,json} (one row per run), matrix_cells.{csv,json} (one row per
cell and baseline) and matrix_splits.{csv,json} into --out (default
results/sim_matrix/); ``--json PATH`` writes all of it, with the verdicts, to one file.
Each run is also appended to matrix_runs.jsonl as it finishes; ``--resume`` keeps those
and runs only the rest (the full matrix takes hours on two cores).
``--freshness`` adds ``staleflow+fresh`` (StaleFlow with the freshness rule on,
coordinator/freshness.py) at StaleFlow's split and seeds, and reports per cell freshness
off against on: throughput on / off (per seed, then the mean), mean staleness of each and
whether the trainer binds, with one verdict per requirement of issue 36::

    python experiments/sim_matrix.py --etas 1,3,5 --seeds 3 --freshness --jobs 2 \
        --json results/freshness_matrix.json

``--stream staleflow`` runs StaleFlow with RolloutPipe's streamed training
(``trainer.stream``; the baselines as they run), ``--stream all`` every system but sync
with it (the same trainer on both sides); rows say ``stream``.

``--small`` runs the same matrix on the ``tiny`` preset's scale: a smoke test of the
script, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from staleflow.sim import SimCluster
from staleflow.sim.audit import StalenessAudit
from staleflow.sim.freshness import (
    FRESH_SYSTEM,
    freshness_cells,
    freshness_verdicts,
    print_freshness,
)
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.report import (
    add_seed_options,
    agentic_verdicts,
    progress,
    results_dir,
    run_each,
    same_split_line,
    seed_list,
    spread,
    stats,
    write_rows,
)
from staleflow.sim.summary import decision_figures

SCRIPT = "sim_matrix"
SYSTEMS = ("staleflow", "sticky", "vanilla", "pipeline", "sync")
FIXED_ETA = {"pipeline": 1, "sync": 0}  # systems with their own bound
NO_SPLIT = ("sync",)  # rolls out and trains on every GPU in turn
ETAS = (1, 3, 5, 10)


class Run(NamedTuple):
    """One simulated run; module-level and picklable for ``--jobs``."""

    workload: str
    system: str
    eta: int
    seed: int
    steps: int
    rollout_gpus: int
    small: bool
    stream: bool = False  # with RolloutPipe's streamed training (``--stream``)


def simulate(run: Run) -> dict[str, Any]:
    w = WORKLOADS[run.workload]
    total = w.total_gpus(run.small)
    config = w.system(
        run.system + ("+stream" if run.stream else ""),
        run.eta,
        steps=run.steps,
        seed=run.seed,
        rollout_gpus=run.rollout_gpus,
        small=run.small,
    )
    started = time.perf_counter()
    cluster = SimCluster(config)
    audit = StalenessAudit().attach(cluster)
    s = cluster.run()
    problems = cluster.check()
    decided = decision_figures(cluster.decisions)  # measured: CPU ms per decision
    return {
        "workload": run.workload,
        "system": run.system,
        "stream": run.stream,
        "eta": config.eta,
        "seed": run.seed,
        "rollout_gpus": run.rollout_gpus if run.system not in NO_SPLIT else total,
        "steps": s.steps,
        "tokens_per_s": s.tokens_per_s,
        "steady_tokens_per_s": s.steady_tokens_per_s,
        "seconds": s.elapsed_s,
        "rampup_s": s.rampup_s,
        "trainer_busy_steady": s.trainer_busy_steady,
        "rollout_idle_ratio": s.rollout_idle_ratio,
        "rollout_prefill_ratio": s.rollout_prefill_ratio,
        "preemptions": s.preemptions,
        "estimate_error": s.estimate_error,
        "max_staleness": max(s.max_staleness_per_batch, default=0),
        "staleness_mean": _mean_staleness(s.staleness),
        "ready_wait_versions": s.ready_wait_versions,
        "audit_max_staleness": audit.max_staleness,
        "audit_max_staleness_oldest_token": audit.max_staleness_oldest_token,
        "audit_trajectories": audit.trajectories,
        "audit_older_later_tokens": len(audit.older_later_tokens),
        "conservation_problems": len(problems),
        "stalled": s.stalled,
        "commands": s.commands,
        "wall_s": time.perf_counter() - started,
        "decision_ms_median": decided.get("decision_ms_median", 0.0),
        "decision_ms_p90": decided.get("decision_ms_p90", 0.0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"{SCRIPT}.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    p.add_argument("--etas", default=",".join(map(str, ETAS)))
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"from {SYSTEMS}")
    p.add_argument("--seed", type=int, default=0, help="first seed (see --seeds)")
    add_seed_options(p)
    p.set_defaults(seeds="3")
    p.add_argument(
        "--splits",
        default="0.375,0.5",
        help="rollout shares of the GPUs the split search tries (e.g. 48 and 64 of 128)",
    )
    p.add_argument(
        "--split-eta",
        type=int,
        default=None,
        help="search the split at this eta only and keep it for every eta "
        "(default: a split per eta)",
    )
    p.add_argument(
        "--search-seeds",
        type=int,
        default=1,
        help="run the split search on this many of the seeds and keep the split with the "
        "best mean (default 1: the first seed; the seeds' runs are then reused by the cells)",
    )
    p.add_argument("--steps", type=int, default=0, help="training steps per run; 0: eta + 8")
    p.add_argument("--small", action="store_true", help="tiny-scale smoke run (no measurement)")
    p.add_argument(
        "--freshness",
        action="store_true",
        help=f"add {FRESH_SYSTEM} at StaleFlow's split and compare freshness off and on",
    )
    p.add_argument(
        "--stream",
        choices=("off", "staleflow", "all"),
        default="off",
        help="RolloutPipe's streamed training (trainer.stream) in StaleFlow's runs only "
        "(the systems as each one runs) or in every system's but sync's (the same trainer "
        "on both sides)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out's matrix_runs.jsonl (an interrupted matrix)",
    )
    p.add_argument("--json", type=Path, default=None, help="write runs, cells and verdicts here")
    p.add_argument("--out", type=Path, default=None, help=f"default results/{SCRIPT}/")
    args = p.parse_args(argv)
    try:
        seeds = seed_list(args.seeds, args.seed)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        p.error(f"unknown workload(s) {unknown}: use {sorted(WORKLOADS)}")
    systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        p.error(f"unknown system(s) {unknown}: use {SYSTEMS}")
    if "staleflow" not in systems:
        p.error("--systems must include staleflow: the matrix compares it with the others")
    etas = [int(e) for e in args.etas.split(",") if e]
    fractions = [float(f) for f in args.splits.split(",") if f]
    if not fractions or not all(0.0 < f < 1.0 for f in fractions):
        p.error("--splits: give rollout shares in (0, 1), e.g. 0.375,0.5")
    if not 1 <= args.search_seeds <= len(seeds):
        p.error(f"--search-seeds: give 1 to {len(seeds)} (the number of --seeds)")
    search_seeds = seeds[: args.search_seeds]
    out = results_dir(args.out, SCRIPT)
    started = time.perf_counter()
    if args.stream != "off":
        who = "StaleFlow's runs" if args.stream == "staleflow" else "every system's but sync's"
        print(f"streamed training (trainer.stream) in {who}")

    def steps(eta: int) -> int:
        return args.steps or eta + 8

    def streams(name: str) -> bool:
        return name not in NO_SPLIT and args.stream in ("all", name)

    def eta_of(name: str, eta: int) -> int:
        return FIXED_ETA.get(name, eta)

    def search_etas(name: str) -> list[int]:
        if args.split_eta is not None:
            return [eta_of(name, args.split_eta)]
        return sorted({eta_of(name, e) for e in etas})

    # Phase 1: each system's best split per workload and eta.
    search: list[Run] = []
    for w in workloads:
        total = WORKLOADS[w].total_gpus(args.small)
        for name in systems:
            if name in NO_SPLIT:
                continue
            for eta in search_etas(name):
                for f, seed in itertools.product(fractions, search_seeds):
                    g = round(f * total)
                    search.append(Run(w, name, eta, seed, steps(eta), g, args.small, streams(name)))
    journal = out / "matrix_runs.jsonl"
    done = _resume(journal) if args.resume else {}
    if not args.resume:
        journal.write_text("")
    _execute(args.jobs, [r for r in search if r not in done], done, "split search", journal)
    # (workload, system, searched eta) -> rollout GPUs
    chosen: dict[tuple[str, str, int], int] = {}
    split_rows = []
    for w in workloads:
        total = WORKLOADS[w].total_gpus(args.small)
        for name in systems:
            if name in NO_SPLIT:
                continue
            for eta in search_etas(name):
                # the mean over the search's seeds: one seed's luck does not pick the split
                per_split: dict[int, list[float]] = {}
                for r in search:
                    if r[:3] == (w, name, eta):
                        per_split.setdefault(r.rollout_gpus, []).append(done[r]["tokens_per_s"])
                tried = [(g, sum(v) / len(v)) for g, v in per_split.items()]
                best = max(tried, key=lambda x: x[1])[0]
                chosen[w, name, eta] = best
                split_rows.append(
                    {
                        "workload": w,
                        "system": name,
                        "eta": eta,
                        "rollout_gpus": best,
                        "of": total,
                        "tried": {str(g): round(v, 1) for g, v in tried},
                    }
                )
                tries = {g: round(v) for g, v in tried}
                print(
                    f"split {w:10s} {name:9s} eta={eta:<2d}: {best}/{total} rollout GPUs  "
                    f"(tried {tries})"
                )

    def split(w: str, name: str, eta: int) -> int:
        if name in NO_SPLIT:  # the layout it is sped up from (unused)
            return WORKLOADS[w].total_gpus(args.small) // 2
        return chosen[w, name, eta if args.split_eta is None else eta_of(name, args.split_eta)]

    # Phase 2: every cell, every seed.
    runs: list[Run] = []
    for w in workloads:
        for name in systems:
            for eta in sorted({eta_of(name, e) for e in etas}):
                for seed in seeds:
                    g = split(w, name, eta)
                    runs.append(Run(w, name, eta, seed, steps(eta), g, args.small, streams(name)))
    if args.freshness:  # StaleFlow's own split: the rule is the only difference
        for w in workloads:
            for eta in etas:
                for seed in seeds:
                    g = split(w, "staleflow", eta)
                    stream = streams("staleflow")
                    runs.append(Run(w, FRESH_SYSTEM, eta, seed, steps(eta), g, args.small, stream))
    _execute(args.jobs, [r for r in runs if r not in done], done, "matrix", journal)
    rows = [done[r] for r in runs]
    main_rows = [r for r in rows if r["system"] != FRESH_SYSTEM]
    cells = cell_rows(main_rows, workloads, etas, systems)
    verdicts = verdict_lines(rows, cells, workloads, etas)
    fresh_cells = freshness_cells(rows, workloads, etas) if args.freshness else []
    verdicts += freshness_verdicts(fresh_cells)
    if same := same_split_line([done[r] for r in dict.fromkeys(search + runs)]):
        verdicts.append(same)
    verdicts += agentic_verdicts(
        cells, [done[r] for r in dict.fromkeys(search + runs)], workloads, etas
    )
    print_cells(cells, main_rows)
    if fresh_cells:
        print_freshness(fresh_cells)
    for line in verdicts:
        print(line)
    took = time.perf_counter() - started
    print(f"{len(done)} runs in {took / 60:.1f} min (--jobs {args.jobs})")
    paths = write_rows(out, "matrix_runs", rows) + write_rows(out, "matrix_cells", cells)
    paths += write_rows(out, "matrix_splits", split_rows)
    if fresh_cells:
        paths += write_rows(out, "matrix_freshness", fresh_cells)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "runs": rows,
                    "cells": cells,
                    "splits": split_rows,
                    "verdicts": verdicts,
                    "freshness": fresh_cells,
                    "minutes": took / 60,
                    "seeds": seeds,
                    "etas": etas,
                },
                indent=2,
            )
            + "\n"
        )
        paths.append(args.json)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _resume(journal: Path) -> dict[Run, dict[str, Any]]:
    """Runs already finished by an earlier, interrupted invocation (one JSON per line)."""
    done: dict[Run, dict[str, Any]] = {}
    if journal.exists():
        for line in journal.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                done[Run(*entry["run"])] = entry["row"]
    return done


def _execute(
    jobs: int,
    runs: list[Run],
    done: dict[Run, dict[str, Any]],
    what: str,
    journal: Path,
) -> None:
    if not runs:
        return
    label = lambda r: f"{r.workload} {r.system} eta={r.eta} seed={r.seed} r={r.rollout_gpus}"  # noqa: E731
    with progress(len(runs), what) as advance:
        for run, row in run_each(jobs, simulate, runs, advance, label):
            done[run] = row
            with journal.open("a") as f:  # a long matrix survives an interruption (--resume)
                f.write(json.dumps({"run": list(run), "row": row}) + "\n")
            print(
                f"{label(run):48s} {row['tokens_per_s']:>8,.0f} tok/s "
                f"(steady {row['steady_tokens_per_s']:,.0f}) staleness<={row['audit_max_staleness']}"
                + (" STALLED" if row["stalled"] else ""),
                flush=True,
            )


def _find(rows: list[dict[str, Any]], w: str, name: str, eta: int, seed: int) -> dict | None:
    for r in rows:
        if (
            r["workload"] == w
            and r["system"] == name
            and r["seed"] == seed
            and (r["eta"] == eta or name in FIXED_ETA)
        ):
            return r
    return None


def cell_rows(
    rows: list[dict[str, Any]], workloads: list[str], etas: list[int], systems: list[str]
) -> list[dict[str, Any]]:
    """One row per (workload, eta, baseline): StaleFlow's ratio over the baseline per seed
    (both runs of a seed see the same workload draws), summarised."""
    out = []
    for w in workloads:
        for eta in etas:
            ours = [
                r
                for r in rows
                if r["workload"] == w and r["system"] == "staleflow" and r["eta"] == eta
            ]
            for base in (s for s in systems if s != "staleflow"):
                ratios, steady = [], []
                for mine in ours:
                    theirs = _find(rows, w, base, eta, mine["seed"])
                    if theirs is None or not theirs["tokens_per_s"]:
                        continue
                    ratios.append(mine["tokens_per_s"] / theirs["tokens_per_s"])
                    if theirs["steady_tokens_per_s"]:
                        steady.append(mine["steady_tokens_per_s"] / theirs["steady_tokens_per_s"])
                if not ratios:
                    continue
                st = stats(ratios)
                cell_runs = ours + [
                    r
                    for r in rows
                    if r["workload"] == w
                    and r["system"] == base
                    and (r["eta"] == eta or base in FIXED_ETA)
                ]
                out.append(
                    {
                        "workload": w,
                        "skewed": WORKLOADS[w].skewed,
                        "eta": eta,
                        "baseline": base,
                        "ratio": st["mean"],
                        "ratio_std": st["std"],
                        "ratio_min": st["min"],
                        "ratio_max": st["max"],
                        "ratio_text": spread(ratios, "{:.3f}"),
                        "steady_ratio": stats(steady)["mean"] if steady else None,
                        "staleflow_tokens_per_s": stats([r["tokens_per_s"] for r in ours])["mean"],
                        "baseline_tokens_per_s": stats(
                            [r["tokens_per_s"] for r in cell_runs if r["system"] == base]
                        )["mean"],
                        "staleflow_trainer_busy_steady": stats(
                            [r["trainer_busy_steady"] for r in ours]
                        )["mean"],
                        "baseline_trainer_busy_steady": stats(
                            [r["trainer_busy_steady"] for r in cell_runs if r["system"] == base]
                        )["mean"],
                        "staleflow_rollout_gpus": sorted({r["rollout_gpus"] for r in ours}),
                        "baseline_rollout_gpus": sorted(
                            {r["rollout_gpus"] for r in cell_runs if r["system"] == base}
                        ),
                        "audit_max_staleness": max(_audited(r) for r in cell_runs),
                        "seeds": len(ratios),
                    }
                )
    return out


def verdict_lines(
    rows: list[dict[str, Any]], cells: list[dict[str, Any]], workloads: list[str], etas: list[int]
) -> list[str]:
    """One line per requirement of issue #17, naming what fails."""
    lines = []
    low = [c for c in cells if c["ratio"] < 1.0 or c["ratio_min"] < 0.98]
    lines.append(
        "verdict: StaleFlow >= 1.00x every baseline in every cell (no seed below 0.98): "
        + (
            "PASS"
            if not low
            else "FAIL in "
            + "; ".join(
                f"{c['workload']} eta={c['eta']} vs {c['baseline']} {c['ratio_text']}" for c in low
            )
        )
    )
    skewed = [w for w in workloads if WORKLOADS[w].skewed]
    by_eta = {}
    for eta in etas:
        vals = [
            c["ratio"]
            for c in cells
            if c["baseline"] == "sticky" and c["eta"] == eta and c["workload"] in skewed
        ]
        if vals:
            by_eta[eta] = sum(vals) / len(vals)
    if 3 in by_eta:
        lines.append(
            f"verdict: >= 1.2x sticky on average over the skewed workloads at eta=3: "
            f"{by_eta[3]:.3f}x over {len(skewed)} workloads: "
            + ("PASS" if by_eta[3] >= 1.2 else "FAIL")
        )
    if by_eta:
        path = [by_eta[e] for e in sorted(by_eta) if e <= 5]
        growing = all(a <= b for a, b in itertools.pairwise(path))
        lines.append(
            "verdict: gain over sticky (skewed workloads) by eta: "
            + ", ".join(f"{e}: {v:.3f}x" for e, v in sorted(by_eta.items()))
            + (
                ": growing from eta=1 to eta=5: " + ("PASS" if growing else "FAIL")
                if len(path) > 1
                else ""
            )
        )
    bad = [r for r in rows if _audited(r) > r["eta"]]
    strict = sum("audit_max_staleness_oldest_token" in r for r in rows)
    failing = "; ".join(
        f"{r['workload']} {r['system']} eta={r['eta']} seed={r['seed']}: {_audited(r)}" for r in bad
    )
    lines.append(
        f"verdict: max staleness <= eta in every run ({len(rows)} runs, audited from the "
        "engines' token versions and the trainer's step, not the manager; against the "
        f"oldest token in {strict} runs, the first token in the others): "
        + ("PASS" if not bad else "FAIL in " + failing)
    )
    moved_back = [
        r for r in rows if r.get("audit_older_later_tokens", r.get("audit_violations", 0))
    ]
    if moved_back:
        lines.append(
            f"note: in {len(moved_back)} runs some trajectory has a token older than its "
            "first (moved to an older instance, which Algorithm 2 allows down to V_traj)"
        )
    broken = [r for r in rows if r["stalled"] or r["conservation_problems"]]
    if broken:
        lines.append(
            "warning: stalled or inconsistent runs: "
            + "; ".join(
                f"{r['workload']} {r['system']} eta={r['eta']} seed={r['seed']}" for r in broken
            )
        )
    return lines


def _mean_staleness(hist: dict[int, int]) -> float:
    total = sum(hist.values())
    return sum(k * n for k, n in hist.items()) / total if total else 0.0


def _audited(row: dict[str, Any]) -> int:
    """The run's audited staleness: against the oldest token where recorded."""
    return int(row.get("audit_max_staleness_oldest_token", row["audit_max_staleness"]))


def _gpus(first: dict[str, Any], mine: dict[str, dict[str, Any]]) -> str:
    """The cell's rollout GPUs: StaleFlow's (sticky's)."""
    out = "/".join(map(str, first.get("staleflow_rollout_gpus", [])))
    if "sticky" in mine:
        out += " (sticky " + "/".join(map(str, mine["sticky"].get("baseline_rollout_gpus", [])))
        out += ")"
    return out


def print_cells(cells: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    bases = list(dict.fromkeys(c["baseline"] for c in cells))
    head = (
        f"{'workload':11s} {'eta':>3s} {'staleflow tok/s':>15s} "
        + " ".join(f"{'/' + b:>26s}" for b in bases)
        + f" {'max stale':>9s} {'trainer busy (steady)':>22s} {'rollout GPUs':>18s}"
    )
    print("\nStaleFlow / baseline per cell, mean +- std [min..max] over seeds")
    print(head)
    keys = list(dict.fromkeys((c["workload"], c["eta"]) for c in cells))
    for w, eta in keys:
        mine = {c["baseline"]: c for c in cells if c["workload"] == w and c["eta"] == eta}
        first = next(iter(mine.values()))
        flag = "*" if first["skewed"] else " "
        busy = f"{first['staleflow_trainer_busy_steady']:.2f}"
        if "sticky" in mine:
            busy += f" (sticky {mine['sticky']['baseline_trainer_busy_steady']:.2f})"
        print(
            f"{w:10s}{flag} {eta:>3d} {first['staleflow_tokens_per_s']:>15,.0f} "
            + " ".join(f"{mine[b]['ratio_text'] if b in mine else 'n/a':>26s}" for b in bases)
            + f" {max(c['audit_max_staleness'] for c in mine.values()):>9d} {busy:>22s}"
            + f" {_gpus(first, mine):>18s}"
        )
    print("* skewed workload (the 1.2x target averages over these)")


if __name__ == "__main__":
    sys.exit(main())
