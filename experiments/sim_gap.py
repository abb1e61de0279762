"""Why StaleFlow and the in-flight-limited baseline are close on the simulator: the
measurements behind "Why our gains differed from the paper's" in
experiments/log/simulator-2026-11-22-before-the-rules.md.

Sections (``--sections``, default all), each StaleFlow against ``vanilla`` (R0S0M0, the
in-flight-limited baseline) on the §6.5 preset at ``--eta``:

- ``prefill``: the (re-)prefill cost, as the prefill MFU of the preset's engine model
  (``--mfus``; the preset calibrates 0.47 against Table 3's 7.9% prefill share);
- ``split``: the rollout / training GPU split (``--splits``), each system at its best;
- ``params``: StaleFlow's mu, phi_wait and phi_throughput, one at a time;
- ``window``: where the (eta + 1) x batch trajectories in flight are, in the steady state;
- ``tail``: the workload's long tail against the statistics the papers report.

    python experiments/sim_gap.py --max-response 40000 --steps 10 --jobs 2

Writes gap_<section>.{csv,json} into --out (default results/sim_gap/).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from staleflow.sim import SimCluster, SyntheticWorkload, WorkloadConfig, paper_6_5, system
from staleflow.sim.presets import PREFILL_MFU, Layout
from staleflow.sim.report import (
    add_seed_options,
    print_table,
    progress,
    results_dir,
    run_each,
    seed_list,
    spread,
    write_rows,
)

SCRIPT = "sim_gap"
SECTIONS = ("prefill", "split", "params", "window", "tail")


class Run(NamedTuple):
    """One simulated run; module-level and picklable for ``--jobs``."""

    section: str
    variant: str
    system: str
    seed: int
    eta: int
    steps: int
    max_response: int
    mfu: float = PREFILL_MFU
    rollout_gpus: int = 64
    train_gpus: int = 64
    coordinator: tuple[tuple[str, float], ...] = ()
    window: bool = False


def simulate(run: Run) -> dict[str, Any]:
    layout = Layout(run.rollout_gpus, run.train_gpus)
    config = paper_6_5(
        eta=run.eta,
        steps=run.steps,
        seed=run.seed,
        max_response=run.max_response,
        layout=layout,
        prefill_mfu=run.mfu,
    )
    if run.coordinator:
        changes: dict[str, Any] = dict(run.coordinator)
        config = config.with_(coordinator=replace(config.coordinator, **changes))
    cluster = SimCluster(system(run.system, config, layout))
    window: list[tuple[float, ...]] = []
    if run.window:
        cluster.observers.append(lambda c: _window(c, window))
    s = cluster.run()
    times = [i.times for i in cluster.instances.values()]
    decode = sum(t.decode for t in times)
    busy = decode + sum(t.prefill + t.pull for t in times)
    row: dict[str, Any] = {
        "section": run.section,
        "variant": run.variant,
        "system": run.system,
        "seed": run.seed,
        "tokens_per_s": s.tokens_per_s,
        "steady_tokens_per_s": s.steady_tokens_per_s,
        "prefill_share": sum(t.prefill for t in times) / busy if busy else 0.0,
        "rollout_idle": s.rollout_idle_ratio,
        "trainer_idle": s.trainer_idle_ratio,
        "decode_tokens_per_s": sum(t.tokens for t in times) / decode if decode else 0.0,
        "preemptions": s.preemptions,
        "stalled": s.stalled,
    }
    if run.window:
        ends = cluster.trainer.step_ends
        start, end = ends[run.eta], ends[-1]  # the steady state: after the warm-up
        w = np.array([r for r in window if start <= r[0] <= end])
        names = ("ts_initial", "ts_admissible", "ts_partial", "running", "queued", "completed")
        for k, name in enumerate(names, start=1):
            row[name] = float(w[:, k].mean()) if len(w) else 0.0
        row["kv_used"] = float(w[:, 7].mean()) if len(w) else 0.0
    return row


def _window(cluster: SimCluster, out: list[tuple[float, ...]]) -> None:
    """Every 5 s: the in-flight trajectories by where they are. ``ts_admissible``: initial
    trajectories the staleness manager would admit at the newest instance version (so
    routing withholds them), the rest of ``ts_initial`` wait for a buffer slot."""
    if int(cluster.now) % 5:
        return
    view = cluster.ts.routing_view()
    initial = [t for t in view if t.v_traj is None]
    newest = max(i.version for i in cluster.instances.values())
    admissible = sum(1 for t in initial if cluster.manager.verify(newest, t.group_id))
    insts = cluster.instances.values()
    kv = np.mean([i.kv / i.cost.kv_budget for i in insts])
    out.append(
        (
            cluster.now,
            len(initial),
            admissible,
            len(view) - len(initial),
            sum(len(i.running) for i in insts),
            sum(len(i.waiting) for i in insts),
            cluster.ts.stats().completed,
            float(kv),
        )
    )


def tail_statistics(max_response: int, seed: int) -> list[dict[str, Any]]:
    """The workload model against the papers' long-tail statistics (no simulation)."""
    w = SyntheticWorkload(WorkloadConfig(max_response=max_response), 16, seed)
    steps = [np.array([w.draw_group()[1] for _ in range(128)]) for _ in range(50)]
    flat = np.concatenate([s.ravel() for s in steps])
    log = np.log(np.stack(steps).reshape(-1, 16))
    between, within = log.mean(axis=1).var(), log.var(axis=1, ddof=1).mean()
    # A VeRL-style static split of a batch (128 groups) over 64 workers, 2 whole groups
    # each: the share of GPU time spent waiting for the slowest worker, when a worker's
    # time follows its longest trajectory (latency-bound) or its total tokens (KV-bound).
    by_worker = [s.reshape(64, 32) for s in steps]
    latency = np.mean([1 - (x.max(1).mean() / x.max(1).max()) for x in by_worker])
    tokens = np.mean([1 - (x.sum(1).mean() / x.sum(1).max()) for x in by_worker])
    last10, idle = sync_rollout_tail(max_response, seed)
    return [
        {"statistic": "mean response / cap", "ours": flat.mean() / max_response},
        {"statistic": "trajectories at the cap", "ours": float(np.mean(flat >= max_response))},
        {"statistic": "2.5th percentile (tokens)", "ours": float(np.percentile(flat, 2.5))},
        {"statistic": "log-length intra-group correlation", "ours": between / (between + within)},
        {"statistic": "idle share, static split, latency-bound", "ours": latency},
        {"statistic": "idle share, static split, KV-bound", "ours": tokens},
        {"statistic": "sync baseline: rollout time of the last 10%", "ours": last10},
        {"statistic": "sync baseline: idle instance time in rollout", "ours": idle},
    ]


def sync_rollout_tail(max_response: int, seed: int, steps: int = 3) -> tuple[float, float]:
    """The synchronous baseline (128 instances, eta = 0) for a few steps: the share of each
    rollout phase spent after 90% of its trajectories finished (Seer's tail latency), and
    the share of instance time idle during rollout phases (SpecActor's waiting for the
    slowest worker), averaged over the steps."""
    layout = Layout()
    config = system("sync", paper_6_5(eta=0, steps=steps, seed=seed, max_response=max_response))
    cluster = SimCluster(config)
    finished: list[float] = []
    busy: list[tuple[float, int]] = []  # (time, running instances) per cycle
    record = cluster._finished

    def on_finish(t: float, inst: Any, traj: Any) -> None:
        finished.append(t)
        record(t, inst, traj)

    cluster._finished = on_finish  # type: ignore[method-assign]
    cluster.observers.append(
        lambda c: busy.append((c.now, sum(1 for i in c.instances.values() if i.running)))
    )
    cluster.run()
    per_step = config.batch_size * config.group_size
    starts = [0.0, *cluster.trainer.step_ends]
    finished.sort()
    tails, idles = [], []
    for k in range(cluster.trainer.steps):
        done = finished[k * per_step : (k + 1) * per_step]
        # The rollout starts at the first cycle with a running instance after the step.
        start = min(t for t, n in busy if t >= starts[k] and n > 0)
        tails.append((done[-1] - done[int(0.9 * per_step) - 1]) / (done[-1] - start))
        phase = [n for t, n in busy if start <= t <= done[-1]]
        idles.append(1.0 - float(np.mean(phase)) / layout.total)
    return float(np.mean(tails)), float(np.mean(idles))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"{SCRIPT}.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"from {SECTIONS}")
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-response", type=int, default=20_000)
    p.add_argument("--mfus", default="0.25,0.47,1.0", help="prefill MFUs for 'prefill'")
    p.add_argument(
        "--splits", default="48/80,64/64,80/48,96/32", help="rollout/training GPUs for 'split'"
    )
    p.add_argument("--seed", type=int, default=0)
    add_seed_options(p)
    p.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default results/{SCRIPT}/)"
    )
    args = p.parse_args(argv)
    try:
        seeds = seed_list(args.seeds, args.seed)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}: use {SECTIONS}")
    out = results_dir(args.out, SCRIPT)
    common = {"eta": args.eta, "steps": args.steps, "max_response": args.max_response}

    runs: list[Run] = []
    both = ("staleflow", "vanilla")
    for seed in seeds:
        if "prefill" in sections:
            for mfu in (float(m) for m in args.mfus.split(",") if m):
                runs += [Run("prefill", f"mfu={mfu:g}", n, seed, mfu=mfu, **common) for n in both]
        if "split" in sections:
            for split in (s for s in args.splits.split(",") if s):
                r, t = (int(x) for x in split.split("/"))
                runs += [
                    Run("split", split, n, seed, rollout_gpus=r, train_gpus=t, **common)
                    for n in both
                ]
        if "params" in sections:
            runs.append(Run("params", "paper (mu 0.3, phi 3 / 5)", "vanilla", seed, **common))
            runs.append(Run("params", "paper (mu 0.3, phi 3 / 5)", "staleflow", seed, **common))
            for key, values in (("mu", (0.1, 0.6)), ("phi_wait", (0, 10))):
                for v in values:
                    c = ((key, v),)
                    runs.append(
                        Run("params", f"{key}={v}", "staleflow", seed, coordinator=c, **common)
                    )
            for v in (2.0, 20.0):
                c = (("phi_throughput", v),)
                runs.append(
                    Run(
                        "params",
                        f"phi_throughput={v:g}",
                        "staleflow",
                        seed,
                        coordinator=c,
                        **common,
                    )
                )
        if "window" in sections:
            runs += [Run("window", "default", n, seed, window=True, **common) for n in both]

    rows: list[dict[str, Any]] = []
    with progress(len(runs), "gap") as advance:
        for _, row in run_each(
            args.jobs, simulate, runs, advance, lambda r: f"{r.section} {r.variant} {r.system}"
        ):
            rows.append(row)
    paths = []
    for section in (s for s in sections if s != "tail"):
        mine = [r for r in rows if r["section"] == section]
        table = _table(mine)
        cols = ["variant", "system", "tokens_per_s", "steady_tokens_per_s", "gain", "steady_gain"]
        cols += ["prefill_share", "rollout_idle", "trainer_idle", "decode_tokens_per_s"]
        if section == "window":
            cols = ["variant", "system", "tokens_per_s", "ts_initial", "ts_admissible"]
            cols += ["ts_partial", "running", "queued", "completed", "kv_used"]
        title = f"{section}: eta={args.eta}, cap {args.max_response}, seeds {seeds}"
        print_table(title, table, cols)
        paths += write_rows(out, f"gap_{section}", mine)
    if "tail" in sections:
        stats = tail_statistics(args.max_response, seeds[0])
        print_table(f"tail: workload at cap {args.max_response}", stats, ["statistic", "ours"])
        paths += write_rows(out, "gap_tail", stats)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (variant, system): means over seeds; ``gain`` is StaleFlow over the
    vanilla run of the same variant and seed (the ``params`` variants use the paper
    setting's vanilla run)."""
    keys = list(dict.fromkeys((r["variant"], r["system"]) for r in rows))
    out = []
    for variant, name in keys:
        mine = [r for r in rows if r["variant"] == variant and r["system"] == name]
        line: dict[str, Any] = {"variant": variant, "system": name}
        for field, value in mine[0].items():
            if isinstance(value, float):
                values = [float(r[field]) for r in mine]
                fmt = "{:,.0f}" if abs(values[0]) >= 100 else "{:.3f}"
                line[field] = spread(values, fmt)
        if name == "staleflow":
            for field, gain in (("tokens_per_s", "gain"), ("steady_tokens_per_s", "steady_gain")):
                ratios = []
                for r in mine:
                    base = _vanilla(rows, variant, r["seed"])
                    if base is not None and base[field]:
                        ratios.append(r[field] / base[field])
                line[gain] = spread(ratios, "{:.3f}") if ratios else ""
        out.append(line)
    return out


def _vanilla(rows: list[dict[str, Any]], variant: str, seed: int) -> dict[str, Any] | None:
    same = [r for r in rows if r["system"] == "vanilla" and r["seed"] == seed]
    for r in same:
        if r["variant"] == variant:
            return r
    return same[0] if same and rows[0]["section"] == "params" else None


if __name__ == "__main__":
    sys.exit(main())
