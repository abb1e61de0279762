"""Output helpers shared by the simulator's experiment scripts (``experiments/sim_*.py``).

A results folder, rows written as CSV and JSON, a summary table on stdout and a progress
bar on stderr (rich), figures through matplotlib's Agg backend. matplotlib is imported
only when a figure is drawn: the simulator itself must not need it.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.presets import PRESETS

Row = dict[str, Any]


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


def preset(name: str, *, eta: int, steps: int, seed: int = 0) -> ClusterConfig:
    return PRESETS[name](eta=eta, steps=steps, seed=seed)


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


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value)
    return value


def print_table(title: str, rows: Sequence[Row], columns: Sequence[str]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("system", "name", "dimension") else "right")
    for row in rows:
        table.add_row(*(_show(row.get(c, "")) for c in columns))
    Console(width=160).print(table)


def _show(value: Any) -> str:
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


def save_figure(fig: Any, out: Path, stem: str) -> Path:
    path = out / f"{stem}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
