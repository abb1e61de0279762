"""Output helpers shared by the simulator's experiment scripts (``experiments/sim_*.py``).

A results folder, rows written as CSV and JSON, a summary table on stdout and a progress
bar on stderr (rich), figures through matplotlib's Agg backend. matplotlib is imported
only when a figure is drawn: the simulator itself must not need it. ``--runs`` reads real
run folders (``staleflow launch``) through :mod:`staleflow.runfolder.reader`.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from staleflow.runfolder.reader import RunFolder, RunFolderError, read_run_folder
from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.presets import AGENTIC, PRESETS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Row = dict[str, Any]
T = TypeVar("T")
R = TypeVar("R")


def parser(script: str, description: str | None, *, steps: int) -> argparse.ArgumentParser:
    """The options every script shares: ``--preset``, ``--steps``, ``--seed``, ``--out``."""
    p = argparse.ArgumentParser(
        prog=f"{script}.py", description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--preset", default="paper-6.5", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=steps, help="training steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default results/{script}/)"
    )
    return p


def add_seed_options(p: argparse.ArgumentParser) -> None:
    """``--seeds`` and ``--jobs`` for the scripts that aggregate over seeds."""
    p.add_argument(
        "--seeds",
        default="1",
        help="a count N (seeds --seed .. --seed+N-1) or a comma-separated list of seeds "
        "(e.g. 0,3,7; a single seed needs the comma: 3,); with more than one seed the "
        "tables report mean +- std and min..max over seeds",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs in parallel processes (results do not depend on it)",
    )


def add_runs_option(p: argparse.ArgumentParser, what: str) -> None:
    """``--runs DIR [DIR ...]``: real run folders instead of a simulation."""
    p.add_argument(
        "--runs",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"real run folders written by `staleflow launch` (runs/<time>-<name>): {what} "
        "from their config.yaml and metrics.jsonl instead of a simulation; the simulation "
        "options are then ignored",
    )


def read_runs(p: argparse.ArgumentParser, paths: Sequence[Path]) -> list[RunFolder]:
    """Every folder of ``--runs``, read with a progress bar; a folder that is not a run
    folder, a malformed metrics line or a run without steps ends the script with the
    reason (exit status 2, as for a bad option). A folder named twice is read once; two
    folders of the same name are told apart by their parent folder's name."""
    unique = list({Path(p).expanduser().resolve(): Path(p) for p in paths}.values())
    runs = []
    error = ""
    with progress(len(unique), "reading runs") as advance:
        for path in unique:
            advance(str(path))
            try:
                runs.append(read_run_folder(path))
            except RunFolderError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"cannot read {path}: {exc}"
            if error:
                break
    if error:
        p.error(error)  # after the bar, so that the message is the last line
    names = Counter(r.name for r in runs)
    return [
        replace(r, name=f"{r.path.resolve().parent.name}/{r.name}") if names[r.name] > 1 else r
        for r in runs
    ]


def seed_list(spec: str, first: int = 0) -> list[int]:
    """``--seeds``: ``"3"`` is three seeds from ``first``; ``"0,5,9"`` (or ``"4,"``) lists them."""
    spec = spec.strip()
    try:
        if "," in spec:
            seeds = [int(x) for x in spec.split(",") if x.strip()]
        else:
            count = int(spec)
            if count < 1:
                raise ValueError
            seeds = list(range(first, first + count))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds {spec!r}: give a count >= 1 or a comma-separated list of integers"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds {spec!r}: seeds must be distinct, at least one")
    return seeds


def stats(values: Sequence[float]) -> dict[str, float]:
    """mean, std (sample, ddof = 1; 0 for one value), min and max of ``values``."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"mean": mean, "std": var**0.5, "min": min(values), "max": max(values)}


def spread(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    """``mean +- std [min..max]`` for a table cell (just the value for one)."""
    s = stats(values)
    if len(values) == 1:
        return fmt.format(s["mean"])
    return (
        f"{fmt.format(s['mean'])} \u00b1 {fmt.format(s['std'])} "
        f"[{fmt.format(s['min'])}..{fmt.format(s['max'])}]"
    )


def run_each(
    jobs: int,
    fn: Callable[[T], R],
    tasks: Sequence[T],
    advance: Callable[[str], None],
    label: Callable[[T], str],
) -> Iterator[tuple[T, R]]:
    """``(task, fn(task))`` for every task, in order, computed on ``jobs`` processes
    (``fn`` must then be picklable: a module-level function). Every run is deterministic
    for its seed, so the results do not depend on ``jobs``; a caller can print each
    result as it arrives."""
    if jobs <= 1 or len(tasks) <= 1:
        for task in tasks:
            advance(label(task))
            yield task, fn(task)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(fn, task) for task in tasks]
        for task, future in zip(tasks, futures, strict=True):
            advance(label(task))
            yield task, future.result()


def preset(
    name: str, *, eta: int, steps: int, seed: int = 0, max_response: int | None = None
) -> ClusterConfig:
    """A named preset; ``max_response`` overrides the response cap (``paper-6.5`` only)."""
    if max_response is None:
        return PRESETS[name](eta=eta, steps=steps, seed=seed)
    if name != "paper-6.5":
        raise ValueError(f"--max-response applies to the paper-6.5 preset, not {name!r}")
    return PRESETS[name](eta=eta, steps=steps, seed=seed, max_response=max_response)


def results_dir(out: Path | None, script: str) -> Path:
    path = out if out is not None else Path("results") / script
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_rows(out: Path, stem: str, rows: Sequence[Row]) -> list[Path]:
    """``stem.json`` keeps nested values as they are; ``stem.csv`` holds them as JSON text so
    that every row stays one line."""
    json_path, csv_path = out / f"{stem}.json", out / f"{stem}.csv"
    json_path.write_text(json.dumps(list(rows), indent=2) + "\n")
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for row in rows:
            w.writerow({k: _cell(v) for k, v in row.items()})
    return [csv_path, json_path]


def _cell(value: object) -> object:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value)
    return value


def print_table(title: str, rows: Sequence[Row], columns: Sequence[str]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(
            c,
            justify="left"
            if c in ("system", "name", "run", "dimension", "variant", "statistic")
            else "right",
        )
    for row in rows:
        table.add_row(*(_show(row.get(c, "")) for c in columns))
    Console(width=160).print(table)


def _show(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


@contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (stdout keeps the table); yields ``advance(label)``,
    which names the run about to start and counts the one before it."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with bar:
        task = bar.add_task(what, total=total)
        started = False

        def advance(label: str) -> None:
            nonlocal started
            bar.update(task, advance=1 if started else 0, description=f"{what}: {label}")
            started = True

        yield advance
        bar.update(task, completed=total, description=what)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, out: Path, stem: str) -> Path:
    path = out / f"{stem}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def same_split_line(rows: list[dict[str, Any]]) -> str | None:
    """StaleFlow against each in-flight-limited baseline on the same split and seed, over
    every run made (the split search's included): what remains of a cell's shortfall once
    the systems' split choices are taken out of it. None without such pairs."""
    key = itemgetter("workload", "eta", "seed", "rollout_gpus", "steps")
    others = {(r["system"], *key(r)): r for r in rows if r["system"] in ("sticky", "vanilla")}
    pairs = []
    for r in rows:
        if r["system"] != "staleflow":
            continue
        for base in ("sticky", "vanilla"):
            o = others.get((base, *key(r)))
            if o is not None:
                pairs.append((r["tokens_per_s"] / o["tokens_per_s"], base, r))
    if not pairs:
        return None
    worst, base, r = min(pairs, key=itemgetter(0))
    below = sum(p[0] < 0.98 for p in pairs)
    return (
        "verdict: StaleFlow >= 0.98x sticky and vanilla on the same split and seed: "
        f"{len(pairs)} pairs, worst {worst:.3f} ({r['workload']} eta={r['eta']} "
        f"seed={r['seed']} {r['rollout_gpus']} rollout GPUs vs {base}): "
        + ("PASS" if not below else f"FAIL ({below} below)")
    )


def agentic_verdicts(
    cells: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    workloads: list[str],
    etas: list[int],
) -> list[str]:
    """One line per requirement of issue #35 on the agentic workloads of the matrix:
    at eta = 3, StaleFlow >= 1.3x sticky and >= 2x sync (mean over seeds, per workload),
    and no seed below 1.0 against sticky on the same split."""
    agentic = [w for w in workloads if w in AGENTIC]
    if not agentic:
        return []
    lines = []
    for base, target in (("sticky", 1.3), ("sync", 2.0)):
        got = [
            c for c in cells if c["workload"] in agentic and c["eta"] == 3 and c["baseline"] == base
        ]
        if got:
            low = [c for c in got if c["ratio"] < target]
            lines.append(
                f"verdict (#35): StaleFlow >= {target}x {base} at eta=3 on the agentic "
                "workloads (mean over seeds): "
                + ", ".join(f"{c['workload']} {c['ratio_text']}" for c in got)
                + (": PASS" if not low else ": FAIL")
            )
    key = itemgetter("workload", "eta", "seed", "rollout_gpus", "steps")
    sticky = {key(r): r for r in rows if r["system"] == "sticky" and r["workload"] in agentic}
    pairs = [
        (r["tokens_per_s"] / sticky[key(r)]["tokens_per_s"], r)
        for r in rows
        if r["system"] == "staleflow" and key(r) in sticky
    ]
    if pairs:
        worst, r = min(pairs, key=itemgetter(0))
        below = sum(p < 1.0 for p, _ in pairs)
        lines.append(
            f"verdict (#35): StaleFlow >= 1.0x sticky on the same split and seed, agentic "
            f"workloads, eta in {etas}: {len(pairs)} pairs, worst {worst:.3f} ({r['workload']} "
            f"eta={r['eta']} seed={r['seed']} {r['rollout_gpus']} rollout GPUs): "
            + ("PASS" if not below else f"FAIL ({below} below)")
        )
    return lines
