"""Reading a run folder written by ``staleflow launch`` (``runs/<time>-<name>/``).

``config.yaml`` (the resolved configuration), ``metrics.jsonl`` (one flat JSON record
per training step, keys in docs/launch.md) and, once the run has finished,
``summary.json``. The dashboard follows a folder while it is written
(``staleflow.dashboard.folder_source``); the experiment scripts read finished ones
(:func:`read_run_folder`). Both read the records and derive per-instance load with
:mod:`staleflow.runfolder.step_record`.

A folder holds one record per training step and nothing between steps, so instance load
is the busy share of each step (from the cumulative per-instance idle ratio) and a Pull is
dated by the step whose record first shows the instance's new version.

This module needs only the standard library and PyYAML: no Ray, torch or FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from staleflow.runfolder.layout import AUDIT, CONFIG, LIVE, METRICS, STATE, SUMMARY, RunLayout
from staleflow.runfolder.run_summary import RunSummary
from staleflow.runfolder.step_record import (
    InstanceStep,
    RecordError,
    StepRecord,
    instance_steps,
    read_records,
)

__all__ = ["AUDIT", "CONFIG", "LIVE", "METRICS", "STATE", "SUMMARY"]  # named in .layout
HOW_TO_MAKE = (
    "a run folder is what `staleflow launch` writes, e.g. `staleflow launch --eta 3 --steps 20` "
    "prints 'run folder runs/<time>-<name>'; experiments/launch_eta_sweep.py makes one per eta"
)


class RunFolderError(ValueError):
    """Not a usable run folder; the message names the file and what to do."""


# -- the files ---------------------------------------------------------------------------


def read_config(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """(raw ``config.yaml`` or None, the problem when None: missing, unreadable...)."""
    file = folder / CONFIG
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        return None, f"{CONFIG} is missing"
    except (OSError, yaml.YAMLError) as exc:
        return None, f"{CONFIG} is unreadable ({exc})"
    if not isinstance(raw, dict):
        return None, f"{CONFIG} is not a mapping"
    return raw, ""


def read_summary(folder: Path) -> RunSummary | None:
    """``summary.json``, or None while the run is unfinished (or it stopped early)."""
    return RunLayout(folder).read_summary()


@dataclass(frozen=True)
class RunFolder:
    """A run folder read at once (see :func:`read_run_folder`)."""

    path: Path
    name: str  # the folder's name, unless a caller needs it told apart from another's
    config: dict[str, Any]
    records: list[StepRecord]
    summary: RunSummary | None = None

    @property
    def finished(self) -> bool:
        """``summary.json`` exists: the launcher reached the end of the run."""
        return self.summary is not None

    @property
    def eta(self) -> int | None:
        return optional_int(self.config.get("eta"))

    @property
    def seed(self) -> int | None:
        return optional_int(self.config.get("seed"))

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def system(self) -> str:
        """The coordinator's strategies under the simulator's names
        (``staleflow.sim.system``): ``staleflow`` (all throughput), ``vanilla`` (all
        vanilla), ``pipeline`` (drain synchronisation, eta 1), ``R?S?M?`` otherwise."""
        coord = self.config.get("coordinator")
        coord = coord if isinstance(coord, dict) else {}
        r, s, m = (
            str(coord.get(k, "throughput")) for k in ("routing", "synchronization", "migration")
        )
        if (r, s, m) == ("throughput",) * 3:
            return "staleflow"
        if (r, s, m) == ("vanilla",) * 3:
            return "vanilla"
        if (r, s, m) == ("vanilla", "drain", "vanilla") and self.eta == 1:
            return "pipeline"
        bit = {"throughput": "1", "vanilla": "0"}
        if all(x in bit for x in (r, s, m)):
            return f"R{bit[r]}S{bit[s]}M{bit[m]}"
        return f"R:{r},S:{s},M:{m}"

    @property
    def elapsed_s(self) -> float:
        return self.records[-1].elapsed_s if self.records else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second since the start of training (the last record)."""
        last = self.records[-1].tokens_per_s if self.records else None
        return last if last is not None else 0.0

    def steady_tokens_per_s(self) -> float | None:
        """Throughput after the warm-up, as the simulator defines it: tokens of the steps
        after the first ``eta + 1`` over the time they took. None without such a step,
        without ``eta`` or without per-step ``train/tokens``."""
        eta = self.eta
        if eta is None or len(self.records) <= eta + 1:
            return None
        tokens = [r.tokens for r in self.records[eta + 1 :]]
        if any(n is None for n in tokens):
            return None
        span = self.records[-1].elapsed_s - self.records[eta].elapsed_s
        return sum(n for n in tokens if n is not None) / span if span > 0 else None

    def staleness_per_step(self) -> list[tuple[int, dict[int, int]]]:
        """Figure 18: ``(V_buf, {staleness: trajectories})`` per training step."""
        return [(r.version, dict(r.staleness)) for r in self.records]

    def staleness_total(self) -> dict[int, int]:
        total: dict[int, int] = {}
        for _, hist in self.staleness_per_step():
            for k, n in hist.items():
                total[k] = total.get(k, 0) + n
        return dict(sorted(total.items()))

    def time_shares(self) -> dict[str, float]:
        """Table 3: shares of all rollout instance-seconds (the last record, cumulative),
        by kind, with ``commands`` (Pull + Route + Interrupt)."""
        return self.records[-1].time_shares() if self.records else {}

    def instance_steps(self) -> list[InstanceStep]:
        """Figure 17: every instance at every step, in step order."""
        out: list[InstanceStep] = []
        prev: StepRecord | None = None
        for rec in self.records:
            out += instance_steps(rec, prev)
            prev = rec
        return out


def read_run_folder(path: str | Path, *, need_steps: bool = True) -> RunFolder:
    """Read a run folder; :class:`RunFolderError` names what is missing or malformed
    (``need_steps``: a run without a training step is an error too)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise RunFolderError(f"{folder} is not a folder: pass a run folder; {HOW_TO_MAKE}")
    missing = [f for f in (METRICS, CONFIG) if not (folder / f).is_file()]
    if missing:
        inner = sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / METRICS).is_file())[
            :3
        ]
        hint = f" (it holds run folders such as {folder / inner[0]}: pass those)" if inner else ""
        raise RunFolderError(
            f"{folder} is not a run folder: {' and '.join(missing)} missing{hint}; {HOW_TO_MAKE}"
        )
    config, problem = read_config(folder)
    if config is None:
        raise RunFolderError(f"{folder / CONFIG}: {problem.removeprefix(CONFIG + ' ')}")
    try:
        records = read_records(folder / METRICS)
    except RecordError as exc:
        raise RunFolderError(str(exc)) from None
    if need_steps and not records:
        raise RunFolderError(
            f"{folder / METRICS} has no training step: the run stopped (or is still "
            "starting) before its first step; rerun it or pass another folder"
        )
    return RunFolder(folder, folder.name, config, records, read_summary(folder))


def optional_int(value: object) -> int | None:
    """``value`` as an int, or None when it is missing, a boolean or not a number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
