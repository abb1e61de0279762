"""Issue #18's ablation: StaleFlow with each absorbed mechanism switched on and off, on the
skewed workloads of the experiment matrix, at several eta, over seeds.

Every mechanism is a *switch* (``SWITCHES``): a name, what it changes, and a function
from a cluster configuration to the configuration with it on. ``off`` is StaleFlow as
configured by ``staleflow.sim.presets.system("staleflow")``; every other variant is
``off`` with its switches applied, on the same workload draws (same seed). RolloutPipe
joined as ``stream`` (its complete-group pipelining: the trainer trains on a buffer's
occupied groups before the buffer is Ready); SpecActor's fastest-of-N as ``race`` (copies
of the oldest buffer's running stragglers race on idle instances of the same version;
simulator only: ``staleflow/sim/race.py``).

    python experiments/sim_seeds.py --seeds 3 --jobs 2 --steps 6 --json results/seeds.json
    python experiments/sim_seeds.py --workloads bimodal --etas 0,3 --variants seer --small
    python experiments/sim_seeds.py --variants stream --etas 0,1,3 --seeds 3 --steps 6
    python experiments/sim_seeds.py --variants race --etas 0,1,3 --seeds 3 --steps 6

Reported per workload, eta and variant (mean +- std [min..max] over seeds): trained
tokens/s and its gain over ``off`` of the same seed; the trainer's idle share; the
oldest buffer's stuck time (mean over consumed batches of the seconds from its 90th
percentile finish to its last, Seer's "long-tail time"); wasted tokens (response tokens
of trajectories aborted); re-prefilled tokens (prefixes prefilled again: resumed
partials, preemptions); chunks re-placed and the probes' mean shortfall (Seer); groups
the trainer streamed before their buffer was Ready, and the mean rollout-to-train-end
seconds per step (RolloutPipe's figure at eta = 0) and its Eq. 4 waiting ratio, the
share of that span before the trainer's first work on the step's groups
(``staleflow.sim.summary`` defines both); the tail race's copies started, races a copy
won, and the losers' tokens after the fork (race-wasted, not in wasted tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from coordinator import RaceConfig, SeerConfig
from staleflow.sim import ClusterConfig, SimCluster, system
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.report import (
    add_seed_options,
    print_table,
    progress,
    results_dir,
    run_each,
    seed_list,
    spread,
    stats,
    write_rows,
)

SCRIPT = "sim_seeds"
SKEWED = [name for name, w in WORKLOADS.items() if w.skewed]


class Switch(NamedTuple):
    what: str
    apply: Callable[[ClusterConfig, int], ClusterConfig]  # (config, chunk tokens)


def _seer(config: ClusterConfig, chunk: int) -> ClusterConfig:
    seer = SeerConfig(enabled=True, chunk_tokens=chunk)
    return replace(config, coordinator=replace(config.coordinator, seer=seer))


def _kv_pool(config: ClusterConfig, chunk: int) -> ClusterConfig:
    return replace(config, engine=replace(config.engine, kv_pool=True))


def _stream(config: ClusterConfig, chunk: int) -> ClusterConfig:
    return replace(config, stream_training=True)


def _race(config: ClusterConfig, chunk: int) -> ClusterConfig:
    race = RaceConfig(enabled=True)
    return replace(config, coordinator=replace(config.coordinator, race=race))


SWITCHES: dict[str, Switch] = {
    "seer": Switch("divided rollout + context-aware scheduling (coordinator.seer)", _seer),
    "kvpool": Switch(
        "a chunk's KV cache stays in a pool every instance reads (Seer's Mooncake; "
        "simulator only): re-placing a chunk costs no prefill",
        _kv_pool,
    ),
    "stream": Switch("RolloutPipe's complete-group pipelining (stream_training)", _stream),
    "race": Switch(
        "SpecActor's fastest-of-N: stragglers of the oldest buffer race on idle instances "
        "(coordinator.race; simulator only)",
        _race,
    ),
}
# variant name -> switches applied to ``off``
VARIANTS: dict[str, tuple[str, ...]] = {
    "off": (),
    "seer": ("seer",),
    "seer+kvpool": ("seer", "kvpool"),
    "stream": ("stream",),
    "seer+stream": ("seer", "stream"),
    "race": ("race",),
    "race+stream": ("race", "stream"),
}
FIELDS = {  # row field -> table format
    "tokens_per_s": "{:,.0f}",
    "gain": "{:.3f}",
    "trainer_idle_ratio": "{:.3f}",
    "tail_s": "{:,.0f}",
    "wasted_tokens": "{:,.0f}",
    "reprefill_tokens": "{:,.0f}",
    "chunks": "{:,.0f}",
    "probe_error": "{:.3f}",
    "streamed_groups": "{:,.0f}",
    "rollout_to_train_end_s": "{:,.1f}",
    "train_wait_ratio": "{:.3f}",
    "races_started": "{:,.1f}",
    "races_won": "{:,.1f}",
    "race_wasted_tokens": "{:,.0f}",
}


class Run(NamedTuple):
    """One simulated run; module-level and picklable for ``--jobs``."""

    workload: str
    eta: int
    variant: str
    seed: int
    steps: int
    chunk: int
    small: bool


def configure(run: Run) -> ClusterConfig:
    base = WORKLOADS[run.workload].config(run.eta, steps=run.steps, seed=run.seed, small=run.small)
    config = system("staleflow", base)
    for name in VARIANTS[run.variant]:
        config = SWITCHES[name].apply(config, run.chunk)
    return config


def simulate(run: Run) -> dict[str, Any]:
    s = SimCluster(configure(run)).run()
    return {
        "workload": run.workload,
        "eta": run.eta,
        "variant": run.variant,
        "seed": run.seed,
        "steps": s.steps,
        "stalled": s.stalled,
        "tokens_per_s": s.tokens_per_s,
        "trainer_idle_ratio": s.trainer_idle_ratio,
        "tail_s": s.tail_s,
        "wasted_tokens": s.wasted_tokens,
        "reprefill_tokens": s.reprefill_tokens,
        "chunks": s.chunks,
        "probe_error": s.probe_error,
        "preemptions": s.preemptions,
        "streamed_groups": s.streamed_groups,
        "streamed_tokens": s.streamed_tokens,
        "rollout_to_train_end_s": s.rollout_to_train_end_s,
        "train_wait_ratio": s.train_wait_ratio,
        "races_started": s.races_started,
        "races_won": s.races_won,
        "race_wasted_tokens": s.race_wasted_tokens,
    }


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"{SCRIPT}.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--workloads", default=",".join(SKEWED), help="comma-separated matrix names")
    p.add_argument("--etas", type=_ints, default=[0, 1, 3], help="comma-separated (0,1,3)")
    p.add_argument(
        "--variants",
        default=",".join(v for v in VARIANTS if v != "off"),
        help=f"besides off, comma-separated from {sorted(v for v in VARIANTS if v != 'off')}",
    )
    p.add_argument("--steps", type=int, default=6, help="training steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="Seer's chunk (default 8192, its paper's, of the 20K cap; 800 with --small)",
    )
    p.add_argument(
        "--small", action="store_true", help="the matrix shapes on the tiny preset (smoke runs)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the summary rows here")
    p.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default results/{SCRIPT}/)"
    )
    add_seed_options(p)
    args = p.parse_args(argv)
    try:
        seeds = seed_list(args.seeds, args.seed)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"--workloads: unknown {unknown}; use names from {sorted(WORKLOADS)}")
    variants = ["off", *(v for v in args.variants.split(",") if v and v != "off")]
    if bad := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {bad}; use names from {sorted(VARIANTS)}")
    chunk = args.chunk_tokens or (800 if args.small else 8192)
    if chunk < 1:
        p.error("--chunk-tokens must be >= 1")
    tasks = [
        Run(w, eta, v, seed, args.steps, chunk, args.small)
        for w in workloads
        for eta in args.etas
        for v in variants
        for seed in seeds
    ]
    runs: list[dict[str, Any]] = []
    with progress(len(tasks), "seeds") as advance:
        label = lambda r: f"{r.workload} eta={r.eta} {r.variant} seed={r.seed}"  # noqa: E731
        for _, row in run_each(args.jobs, simulate, tasks, advance, label):
            runs.append(row)
            print(
                f"{row['workload']} eta={row['eta']} {row['variant']} seed={row['seed']}: "
                f"{row['tokens_per_s']:,.0f} tok/s, tail {row['tail_s']:,.0f} s, "
                f"{row['chunks']} chunks, {row['streamed_groups']} groups streamed, "
                f"{row['races_started']} races ({row['races_won']} won)"
                + (" STALLED" if row["stalled"] else ""),
                flush=True,
            )
    off = {(r["workload"], r["eta"], r["seed"]): r for r in runs if r["variant"] == "off"}
    for r in runs:
        r["gain"] = r["tokens_per_s"] / (
            off[r["workload"], r["eta"], r["seed"]]["tokens_per_s"] or 1.0
        )
    rows = [
        _combine([r for r in runs if (r["workload"], r["eta"], r["variant"]) == key])
        for key in dict.fromkeys((r["workload"], r["eta"], r["variant"]) for r in runs)
    ]
    cols = ["workload", "eta", "variant", *FIELDS, "stalled"]
    title = (
        f"StaleFlow with each mechanism off / on ({len(seeds)} seeds: mean \u00b1 std; "
        "min..max in the JSON)"
    )
    print_table(
        title, [{**r, **{c: r.get(f"{c}_cell", r.get(c)) for c in cols}} for r in rows], cols
    )
    out = results_dir(args.out, SCRIPT)
    paths = write_rows(out, "seeds", rows) + write_rows(out, "seeds_runs", runs)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "argv": sys.argv[1:] if argv is None else argv,
            "switches": {k: s.what for k, s in SWITCHES.items()},
        }
        args.json.write_text(
            json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2) + "\n"
        )
        paths.append(args.json)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    row: dict[str, Any] = {
        "workload": first["workload"],
        "eta": first["eta"],
        "variant": first["variant"],
        "seeds": [r["seed"] for r in runs],
        "steps": min(r["steps"] for r in runs),
        "stalled": sum(bool(r["stalled"]) for r in runs),
    }
    for field, fmt in FIELDS.items():
        values = [float(r[field]) for r in runs]
        s = stats(values)
        row[field] = s["mean"]
        row.update({f"{field}_{k}": v for k, v in s.items() if k != "mean"})
        row[f"{field}_text"] = spread(values, fmt)
        row[f"{field}_cell"] = _cell(s, fmt, len(values))
    return row


def _cell(s: dict[str, float], fmt: str, n: int) -> str:
    """A narrow table cell: mean +- std (the JSON keeps min and max too)."""
    if n == 1:
        return fmt.format(s["mean"])
    return f"{fmt.format(s['mean'])} \u00b1 {fmt.format(s['std'])}"


if __name__ == "__main__":
    sys.exit(main())
