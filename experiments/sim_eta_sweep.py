"""Sweep the staleness bound eta on the simulated cluster and compare systems (§6.2, §6.5).

Example (the paper's §6.5 cluster, three seeds, a few minutes per seed on two cores)::

    python experiments/sim_eta_sweep.py --preset paper-6.5 --seeds 3 --json out.json

Prints one row per (system, eta, seed): throughput, time, staleness histogram, idle ratios;
then, per (system, eta), mean +- std [min..max] over the seeds, and StaleFlow's gain over
each baseline. A gain is computed per seed (both systems see the same workload draws for
a seed) and then summarised over seeds.
Writes sweep.{csv,json} (one row per run), sweep_stats.{csv,json} (per system and eta),
gains.{csv,json} (StaleFlow over each baseline per eta) and a Figure-13-style
eta_sweep.png into --out (default results/sim_eta_sweep/).

Real runs: ``--runs DIR [DIR ...]`` tabulates finished run folders written by
``staleflow launch`` (or experiments/launch_eta_sweep.py) by eta instead of simulating;
the simulation options are then ignored::

    python experiments/launch_eta_sweep.py --etas 0 1 3 --steps 30    # results/launch/*
    python experiments/sim_eta_sweep.py --runs results/launch/*

One row per run in sweep.{csv,json}: ``name`` is the coordinator's strategies under the
simulator's names (``staleflow``, ``vanilla``, ``R1S0M1``...), ``run`` the folder, then
eta, steps, tokens/s (the last record's ``throughput/tokens_per_s``), steady tokens/s
(after the first eta + 1 steps, as in the simulator; n/a for a run too short), the
staleness histogram (trajectories) and its maximum, the reward at the start and the end,
idle ratios and the Table 3 time shares (``time_share_{pull,route,interrupt,prefill,
decode,commands}``). sweep_stats has mean +- std [min..max] over the runs of a (name, eta)
(repeats, e.g. ``launch_eta_sweep.py --repeats``), and gains.{csv,json} the throughput of
every eta > 0 over the eta = 0 runs of the same name (``baseline`` "eta=0"): ``gain`` is
the ratio of the mean throughputs, ``gain_min``/``gain_max`` the extreme ratios of any
two runs. Runs without summary.json (unfinished or stopped) are included and flagged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from staleflow.runfolder.reader import RunFolder
from staleflow.runfolder.step_record import reward_mean, trainer_idle_ratio
from staleflow.sim import PRESETS, SYSTEMS, SimCluster, system
from staleflow.sim.presets import Layout
from staleflow.sim.report import (
    add_runs_option,
    add_seed_options,
    print_table,
    progress,
    pyplot,
    read_runs,
    results_dir,
    run_each,
    save_figure,
    seed_list,
    spread,
    stats,
    write_rows,
)

SCRIPT = "sim_eta_sweep"


class Run(NamedTuple):
    """One simulated run; module-level and picklable for ``--jobs``."""

    name: str
    eta: int  # the requested bound (a system with its own bound ignores it)
    seed: int
    steps: int
    preset: str
    kwargs: dict[str, Any]
    layout: Layout | None
    fixed: bool


def simulate(run: Run) -> dict[str, Any]:
    preset = PRESETS[run.preset](eta=run.eta, steps=run.steps, seed=run.seed, **run.kwargs)
    config = system(run.name, preset, run.layout)
    started = time.perf_counter()
    s = SimCluster(config).run()
    wall = time.perf_counter() - started
    return {**s.as_dict(), "seed": run.seed, "wall_s": wall, "fixed_eta": run.fixed}


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
    p.add_argument("--seed", type=int, default=0, help="first seed (see --seeds)")
    add_seed_options(p)
    p.add_argument("--rollout-gpus", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--train-gpus", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--max-response", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--json", type=Path, default=None, help="write every summary here")
    p.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default results/{SCRIPT}/)"
    )
    add_runs_option(p, "the sweep table, statistics, gains over eta=0 and the figure")
    args = p.parse_args(argv)
    if args.runs:
        runs = read_runs(p, args.runs)
        if missing := [r.name for r in runs if r.eta is None]:
            p.error(f"config.yaml of {', '.join(missing)} has no integer eta")
        return from_runs(runs, results_dir(args.out, SCRIPT), args.json)
    try:
        seeds = seed_list(args.seeds, args.seed)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))

    etas = [int(e) for e in args.etas.split(",") if e]
    names = [s for s in args.systems.split(",") if s]
    layout: Layout | None = None
    kwargs: dict[str, Any] = {}
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
    # Systems that set their own bound (sync: 0, pipeline: 1) ignore the requested one.
    probe = 1 + max(etas, default=0)
    fixed = {
        n: system(n, PRESETS[args.preset](eta=probe, **kwargs), layout).eta != probe for n in names
    }
    runs: list[Run] = []
    done: set[tuple[str, int, int]] = set()
    for name in names:
        for eta in etas:
            steps = args.steps or max(8, 2 * eta + 6)
            config = system(name, PRESETS[args.preset](eta=eta, steps=steps, **kwargs), layout)
            for seed in seeds:
                if (name, config.eta, seed) in done:
                    continue  # a system with its own bound (sync: 0, pipeline: 1) runs once
                done.add((name, config.eta, seed))
                runs.append(Run(name, eta, seed, steps, args.preset, kwargs, layout, fixed[name]))

    results: list[dict[str, Any]] = []
    header = (
        f"{'system':<10} {'eta':>3} {'seed':>4} {'tok/s':>9} {'steady':>9} {'steps':>5} "
        f"{'sim s':>7} {'wall s':>6} {'roll idle':>9} {'prefill':>7} {'trn idle':>8} "
        f"{'preempt':>7}  staleness"
    )
    print(header)
    with progress(len(runs), "eta sweep") as advance:
        for _, r in run_each(
            args.jobs, simulate, runs, advance, lambda r: f"{r.name} eta={r.eta} seed={r.seed}"
        ):
            results.append(r)
            print(
                f"{r['name']:<10} {r['eta']:>3} {r['seed']:>4} {r['tokens_per_s']:>9.0f} "
                f"{r['steady_tokens_per_s']:>9.0f} {r['steps']:>5} {r['seconds']:>7.0f} "
                f"{r['wall_s']:>6.1f} {r['rollout_idle_ratio']:>9.3f} "
                f"{r['rollout_prefill_ratio']:>7.3f} {r['trainer_idle_ratio']:>8.3f} "
                f"{r['preemptions']:>7}  {r['staleness']}" + ("  STALLED" if r["stalled"] else ""),
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    summary = sweep_stats(results)
    table = gains(results)
    if len(seeds) > 1:
        print(f"\nover {len(seeds)} seeds {seeds}: mean \u00b1 std [min..max]")
        for row in summary:
            print(
                f"{row['name']:<10} eta={row['eta']:<3} tok/s {row['tokens_per_s_text']:<36} "
                f"steady {row['steady_tokens_per_s_text']}"
                + (f"  STALLED in {row['stalled']} run(s)" if row["stalled"] else "")
            )
    for g in table:
        print(
            f"staleflow over {g['baseline']} at eta={g['eta']}: {g['gain_text']}x "
            f"(steady: {g['steady_gain_text']}x)"
        )
    paths = write_rows(out, "sweep", results)
    paths += write_rows(out, "sweep_stats", summary) + write_rows(out, "gains", table)
    if results:
        paths.append(_plot(summary, table, etas, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


# -- real runs ---------------------------------------------------------------------------

SHARES = ("pull", "route", "interrupt", "prefill", "decode", "commands")


def from_runs(runs: list[RunFolder], out: Path, json_path: Path | None) -> int:
    """The sweep of real run folders: table, statistics, gains over eta=0, figure."""
    rows = sorted((run_row(r) for r in runs), key=lambda r: (r["name"], r["eta"], r["run"]))
    print_table(
        "Figure 13 from run folders: throughput by eta",
        rows,
        [
            *("name", "run", "eta", "steps", "tokens_per_s", "steady_tokens_per_s"),
            *("staleness_max", "trainer_idle_ratio", "rollout_idle_ratio"),
        ],
    )
    print_table(
        "Table 3 from run folders: shares of all rollout instance-seconds",
        rows,
        ["run", "eta", *(f"time_share_{k}" for k in SHARES)],
    )
    for r in rows:
        if not r["finished"]:
            print(f"note: {r['run']} has no summary.json (unfinished or stopped early)")
    summary = run_stats(rows)
    table = run_gains(rows)
    for row in summary:
        if len(row["runs"]) > 1:
            print(
                f"{row['name']:<10} eta={row['eta']:<3} over {len(row['runs'])} runs: tok/s "
                f"{row['tokens_per_s_text']:<36} steady {row['steady_tokens_per_s_text']}"
            )
    for g in table:
        print(
            f"{g['name']} eta={g['eta']} over eta=0: {g['gain_text']}x "
            f"(steady: {g['steady_gain_text']}x)"
        )
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {json_path}")
    paths = write_rows(out, "sweep", rows)
    paths += write_rows(out, "sweep_stats", summary) + write_rows(out, "gains", table)
    paths.append(_plot_runs(summary, table, out))
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def run_row(run: RunFolder) -> dict[str, Any]:
    """One real run as a sweep row (see the module docstring)."""
    k = max(1, run.steps // 4)
    records = run.records
    hist = run.staleness_total()
    shares = run.time_shares()
    row: dict[str, Any] = {
        "name": run.system,
        "run": run.name,
        "eta": run.eta,
        "seed": run.seed,
        "steps": run.steps,
        "finished": run.finished,
        "seconds": run.elapsed_s,
        "tokens_per_s": run.tokens_per_s,
        "steady_tokens_per_s": run.steady_tokens_per_s(),
        "staleness": {str(s): n for s, n in hist.items()},
        "staleness_max": max(hist, default=0),
        "reward_start": reward_mean(records[:k]),
        "reward_end": reward_mean(records[-k:]),
        "trainer_idle_ratio": trainer_idle_ratio(records),
        "rollout_idle_ratio": records[-1].rollout_idle_ratio,
    }
    row.update({f"time_share_{k}": shares.get(k) for k in SHARES})
    row["path"] = str(run.path)
    return row


def run_stats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (name, eta): throughput and steady throughput over the runs (repeats)."""
    out = []
    for name, eta in dict.fromkeys((r["name"], r["eta"]) for r in rows):
        mine = [r for r in rows if r["name"] == name and r["eta"] == eta]
        row: dict[str, Any] = {"name": name, "eta": eta, "runs": [r["run"] for r in mine]}
        for field in ("tokens_per_s", "steady_tokens_per_s"):
            values = [float(r[field]) for r in mine if r[field] is not None]
            if values:
                row.update({f"{field}_{k}": v for k, v in stats(values).items()})
                row[f"{field}_text"] = spread(values, "{:,.1f}")
            else:
                row.update({f"{field}_{k}": None for k in ("mean", "std", "min", "max")})
                row[f"{field}_text"] = "n/a"
        row["unfinished"] = sum(not r["finished"] for r in mine)
        out.append(row)
    return out


def run_gains(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every eta > 0 over the eta = 0 runs of the same name: the ratio of the mean
    throughputs, and the lowest and highest ratio of any two runs."""
    out = []
    for name, eta in dict.fromkeys((r["name"], r["eta"]) for r in rows if r["eta"] > 0):
        base = [r for r in rows if r["name"] == name and r["eta"] == 0]
        mine = [r for r in rows if r["name"] == name and r["eta"] == eta]
        ratio = _ratio([r["tokens_per_s"] for r in mine], [r["tokens_per_s"] for r in base])
        if ratio is None:
            continue
        row: dict[str, Any] = {
            "name": name,
            "eta": eta,
            "baseline": "eta=0",
            "runs": [r["run"] for r in mine],
            "baseline_runs": [r["run"] for r in base],
            **ratio,
        }
        steady = _ratio(
            [r["steady_tokens_per_s"] for r in mine], [r["steady_tokens_per_s"] for r in base]
        )
        row["steady_gain"] = steady["gain"] if steady else None
        row["steady_gain_text"] = steady["gain_text"] if steady else "n/a"
        out.append(row)
    return out


def _ratio(mine: list[float | None], base: list[float | None]) -> dict[str, Any] | None:
    ours = [float(v) for v in mine if v is not None]
    theirs = [float(v) for v in base if v]
    if not ours or not theirs:
        return None
    gain = (sum(ours) / len(ours)) / (sum(theirs) / len(theirs))
    low, high = min(ours) / max(theirs), max(ours) / min(theirs)
    text = f"{gain:.3f}" if low == high else f"{gain:.3f} [{low:.3f}..{high:.3f}]"
    return {"gain": gain, "gain_min": low, "gain_max": high, "gain_text": text}


def _plot_runs(summary: list[dict[str, Any]], table: list[dict[str, Any]], out: Path) -> Path:
    plt = pyplot()
    etas = sorted({r["eta"] for r in summary})
    names = list(dict.fromkeys(r["name"] for r in summary))
    gain = {(g["name"], g["eta"]): g["gain"] for g in table}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(etas)), 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        mine = {r["eta"]: r for r in summary if r["name"] == name}
        shown = [e for e in etas if e in mine]
        xs = [etas.index(e) + (k - (len(names) - 1) / 2) * width for e in shown]
        ys = [mine[e]["tokens_per_s_mean"] for e in shown]
        errs = [mine[e]["tokens_per_s_std"] for e in shown]
        bars = ax.bar(xs, ys, width, yerr=errs if any(errs) else None, label=name)
        labels = [f"({gain[name, e]:.2f}x)" if (name, e) in gain else "" for e in shown]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.set_xticks(range(len(etas)), [f"eta={e}" for e in etas])
    ax.set_ylabel("tokens/s (mean over runs, std as error bar)")
    ax.set_title("Throughput vs staleness bound, real runs\n(x): gain over eta=0", fontsize=10)
    ax.legend(fontsize="small")
    return save_figure(fig, out, "eta_sweep")


# -- statistics of simulated runs --------------------------------------------------------


def sweep_stats(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (system, eta): throughput and steady throughput over the seeds."""
    keys = list(dict.fromkeys((r["name"], r["eta"]) for r in results))
    out = []
    for name, eta in keys:
        rows = [r for r in results if r["name"] == name and r["eta"] == eta]
        row: dict[str, Any] = {"name": name, "eta": eta, "seeds": [r["seed"] for r in rows]}
        row["fixed_eta"] = rows[0]["fixed_eta"]
        for field in ("tokens_per_s", "steady_tokens_per_s"):
            values = [float(r[field]) for r in rows]
            row.update({f"{field}_{k}": v for k, v in stats(values).items()})
            row[f"{field}_text"] = spread(values, "{:,.0f}")
        row["stalled"] = sum(bool(r["stalled"]) for r in rows)
        out.append(row)
    return out


def gains(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """StaleFlow's throughput over each baseline's at the same eta, per seed (the same
    seed draws the same workload for both), summarised over seeds: ``gain`` is the mean.
    A baseline with its own bound (``fixed_eta``: sync, pipeline) ran once per seed and is
    compared at every eta, as VeRL and VeRL-Pipeline are in Figure 13."""
    ours = [r for r in results if r["name"] == "staleflow"]
    etas = list(dict.fromkeys(r["eta"] for r in ours))
    bases = list(dict.fromkeys(r["name"] for r in results if r["name"] != "staleflow"))
    out = []
    for eta in etas:
        for base in bases:
            ratios: dict[str, list[float]] = {"tokens_per_s": [], "steady_tokens_per_s": []}
            seeds = []
            for mine in (r for r in ours if r["eta"] == eta):
                theirs = _run(results, base, eta, mine["seed"])
                if theirs is None or not theirs["tokens_per_s"]:
                    continue
                seeds.append(mine["seed"])
                for field, values in ratios.items():
                    if theirs[field]:
                        values.append(mine[field] / theirs[field])
            if not seeds:
                continue
            row: dict[str, Any] = {"eta": eta, "baseline": base, "seeds": seeds}
            g = stats(ratios["tokens_per_s"])
            row.update({"gain": g["mean"], "gain_std": g["std"]})
            row.update({"gain_min": g["min"], "gain_max": g["max"]})
            row["gain_text"] = spread(ratios["tokens_per_s"], "{:.3f}")
            steady = ratios["steady_tokens_per_s"]
            row["steady_gain"] = stats(steady)["mean"] if steady else None
            row["steady_gain_text"] = spread(steady, "{:.3f}") if steady else "n/a"
            out.append(row)
    return out


def _run(results: list[dict[str, Any]], name: str, eta: int, seed: int) -> dict[str, Any] | None:
    for r in results:
        if r["name"] == name and r["seed"] == seed and (r["eta"] == eta or r["fixed_eta"]):
            return r
    return None


def _mean(summary: list[dict[str, Any]], name: str, eta: int) -> tuple[float, float] | None:
    for r in summary:
        if r["name"] == name and (r["eta"] == eta or r["fixed_eta"]):
            return float(r["tokens_per_s_mean"]), float(r["tokens_per_s_std"])
    return None


def _plot(
    summary: list[dict[str, Any]], table: list[dict[str, Any]], etas: list[int], out: Path
) -> Path:
    plt = pyplot()
    names = list(dict.fromkeys(r["name"] for r in summary))
    gain = {(g["baseline"], g["eta"]): g["gain"] for g in table}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(etas)), 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, ys, errs = [], [], []
        for j, eta in enumerate(etas):
            y = _mean(summary, name, eta)
            if y is not None:
                xs.append(j + (k - (len(names) - 1) / 2) * width)
                ys.append(y[0])
                errs.append(y[1])
        bars = ax.bar(xs, ys, width, yerr=errs if any(errs) else None, label=name)
        if name != "staleflow":
            labels = [f"({gain[name, e]:.2f}x)" if (name, e) in gain else "" for e in etas]
            if len(labels) == len(bars):
                ax.bar_label(bars, labels=labels, fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(etas)), [f"eta={e}" for e in etas])
    ax.set_ylabel("tokens/s (mean over seeds, std as error bar)")
    ax.set_title(
        "Throughput vs staleness bound\n(x): StaleFlow's mean gain over that baseline",
        fontsize=10,
    )
    ax.legend(fontsize="small")
    return save_figure(fig, out, "eta_sweep")


if __name__ == "__main__":
    sys.exit(main())
