"""Reading a run folder written by ``staleflow launch`` (``runs/<time>-<name>/``).

``config.yaml`` (the resolved configuration), ``metrics.jsonl`` (one flat JSON record
per training step, keys in docs/launch.md) and, once the run has finished,
``summary.json``. The dashboard follows a folder while it is written
(``staleflow.dashboard.folder_source``); the experiment scripts read finished ones
(:func:`read_run_folder`). Both derive per-instance load from the same helpers here.

A folder holds one record per training step and nothing between steps, so instance load
is the busy share of each step (from the cumulative ``rollout/idle_ratio/<inst>``) and a
Pull is dated by the step whose record first shows the new ``rollout/version/<inst>``.

This module needs only the standard library and PyYAML: no Ray, torch or FastAPI.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONFIG, METRICS, SUMMARY = "config.yaml", "metrics.jsonl", "summary.json"
HOW_TO_MAKE = (
    "a run folder is what `staleflow launch` writes, e.g. `staleflow launch --eta 3 --steps 20` "
    "prints 'run folder runs/<time>-<name>'; experiments/launch_eta_sweep.py makes one per eta"
)

Record = dict[str, float]


class RunFolderError(ValueError):
    """Not a usable run folder; the message names the file and what to do."""


# -- one record --------------------------------------------------------------------------


def parse_record(line: str | bytes) -> Record:
    """One ``metrics.jsonl`` line as ``{key: float}``; ``ValueError`` if it is not a JSON
    object of numbers."""
    rec = json.loads(line)
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    try:
        return {str(k): float(v) for k, v in rec.items()}
    except (TypeError, ValueError):
        bad = next(k for k, v in rec.items() if not _number(v))
        raise ValueError(f"{bad!r} is not a number: {rec[bad]!r}") from None


def _number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def record_instances(rec: Mapping[str, float]) -> list[int]:
    """The rollout instances a record reports (``rollout/idle_ratio/<inst>``)."""
    prefix = "rollout/idle_ratio/"
    out = []
    for key in rec:
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            out.append(int(key[len(prefix) :]))
    return sorted(out)


def step_busy(
    rec: Mapping[str, float], prev: Mapping[str, float] | None, inst: int
) -> float | None:
    """Busy share of one step: ``rollout/idle_ratio/<inst>`` is cumulative over the run
    (idle seconds / lifetime), so the step's idle seconds are the difference of
    ``ratio x elapsed``; clamped, since an instance lives slightly longer than the run's
    clock."""
    ratio = rec.get(f"rollout/idle_ratio/{inst}")
    if ratio is None:
        return None
    t = rec.get("time/elapsed_s", 0.0)
    t0 = prev.get("time/elapsed_s", 0.0) if prev else 0.0
    before = prev.get(f"rollout/idle_ratio/{inst}", 0.0) if prev else 0.0
    span = t - t0
    if span <= 0:
        return min(max(1.0 - ratio, 0.0), 1.0)
    idle = (ratio * t - before * t0) / span
    return min(max(1.0 - idle, 0.0), 1.0)


@dataclass(frozen=True, slots=True)
class InstanceStep:
    """One instance during one training step (Figure 17 from a run folder)."""

    step: int
    time: float  # time/elapsed_s at the end of the step
    inst: int
    version: int | None  # weights version held at the end of the step
    busy_ratio: float | None  # share of the step the instance had something to generate
    pulled: bool  # its version changed during the step (a Pull of ``version``)


def instance_steps(
    rec: Mapping[str, float], prev: Mapping[str, float] | None
) -> list[InstanceStep]:
    """Every instance of ``rec`` against the record before it (None for the first step:
    instances start with version 0)."""
    t = rec.get("time/elapsed_s", 0.0)
    step = int(rec.get("step", 0))
    out = []
    for inst in record_instances(rec):
        version = rec.get(f"rollout/version/{inst}")
        before = prev.get(f"rollout/version/{inst}") if prev else 0.0
        out.append(
            InstanceStep(
                step=step,
                time=t,
                inst=inst,
                version=None if version is None else int(version),
                busy_ratio=step_busy(rec, prev, inst),
                pulled=version is not None and before is not None and version != before,
            )
        )
    return out


def staleness_hist(rec: Mapping[str, float]) -> dict[int, int]:
    """``{V_buf - V_traj: trajectories}`` of one step's batch."""
    prefix = "staleness/hist/"
    out = {}
    for key, n in rec.items():
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            out[int(key[len(prefix) :])] = int(n)
    return dict(sorted(out.items()))


def reward_mean(records: Sequence[Mapping[str, float]]) -> float | None:
    """Mean reward of every trajectory rewarded during these steps (each step's mean
    weighted by how many it rewarded: rewards arrive in bursts, not one batch a step)."""
    n = sum(r.get("rollout/rewarded", 0.0) for r in records if "rollout/reward_mean" in r)
    if not n:
        return None
    total = sum(
        r["rollout/reward_mean"] * r["rollout/rewarded"]
        for r in records
        if "rollout/reward_mean" in r
    )
    return total / n


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


def read_summary(folder: Path) -> dict[str, Any] | None:
    """``summary.json``, or None while the run is unfinished (or it stopped early)."""
    try:
        data = json.loads((folder / SUMMARY).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_records(file: Path) -> list[Record]:
    """Every record of a ``metrics.jsonl``; a malformed line is an error naming the file
    and the line number."""
    out = []
    with file.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(parse_record(line))
            except ValueError as exc:
                hint = (
                    ""
                    if line.endswith(b"\n")
                    else " (an unfinished last line: is the run still writing?)"
                )
                raise RunFolderError(
                    f"{file} line {number}: malformed metrics record: {exc}{hint}"
                ) from None
    return out


@dataclass(frozen=True)
class RunFolder:
    """A run folder read at once (see :func:`read_run_folder`)."""

    path: Path
    name: str  # the folder's name, unless a caller needs it told apart from another's
    config: dict[str, Any]
    records: list[Record]
    summary: dict[str, Any] | None = None

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
        return self.records[-1].get("time/elapsed_s", 0.0) if self.records else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second since the start of training (the last record)."""
        return self.records[-1].get("throughput/tokens_per_s", 0.0) if self.records else 0.0

    def steady_tokens_per_s(self) -> float | None:
        """Throughput after the warm-up, as the simulator defines it: tokens of the steps
        after the first ``eta + 1`` over the time they took. None without such a step,
        without ``eta`` or without per-step ``train/tokens``."""
        eta = self.eta
        if eta is None or len(self.records) <= eta + 1:
            return None
        tail = self.records[eta + 1 :]
        if any("train/tokens" not in r for r in tail):
            return None
        span = self.records[-1].get("time/elapsed_s", 0.0) - self.records[eta].get(
            "time/elapsed_s", 0.0
        )
        return sum(r["train/tokens"] for r in tail) / span if span > 0 else None

    def staleness_per_step(self) -> list[tuple[int, dict[int, int]]]:
        """Figure 18: ``(V_buf, {staleness: trajectories})`` per training step."""
        return [(int(r.get("version", i)), staleness_hist(r)) for i, r in enumerate(self.records)]

    def staleness_total(self) -> dict[int, int]:
        total: dict[int, int] = {}
        for _, hist in self.staleness_per_step():
            for k, n in hist.items():
                total[k] = total.get(k, 0) + n
        return dict(sorted(total.items()))

    def time_shares(self) -> dict[str, float]:
        """Table 3: shares of all rollout instance-seconds (the last record, cumulative)."""
        prefix = "rollout/time_share/"
        last = self.records[-1] if self.records else {}
        return {k.removeprefix(prefix): v for k, v in last.items() if k.startswith(prefix)}

    def instance_steps(self) -> list[InstanceStep]:
        """Figure 17: every instance at every step, in step order."""
        out: list[InstanceStep] = []
        prev: Record | None = None
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
    records = read_records(folder / METRICS)
    if need_steps and not records:
        raise RunFolderError(
            f"{folder / METRICS} has no training step: the run stopped (or is still "
            "starting) before its first step; rerun it or pass another folder"
        )
    return RunFolder(folder, folder.name, config, records, read_summary(folder))


def optional_int(value: Any) -> int | None:
    """``value`` as an int, or None when it is missing, a boolean or not a number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
