"""A run folder (``config.yaml``, ``metrics.jsonl``, ``summary.json``) as a dashboard
source, finished or still being written by ``staleflow launch``.

A folder holds one record per training step and nothing between steps, so what the page
draws from it is coarser than from a live run: instance load is the busy share of each
step (from the cumulative per-instance idle ratio), and Pulls and Pushes are dated by the
step whose record first shows the new version (``staleflow.runfolder.step_record``, which the
experiment scripts read finished run folders with too). Buffers, trajectory
counts and instance snapshots exist only while the run is alive: attach with
``--address`` for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from staleflow.dashboard.interface import (
    ActionNotSupported,
    InstanceDetail,
    LiveView,
    LoadSample,
    Page,
    PSView,
    RunEvent,
    RunInfo,
)
from staleflow.dashboard.runconfig import cost_model_at, read_run_config
from staleflow.dashboard.timeline import SeqLog
from staleflow.runfolder.layout import CONFIG, METRICS, RunLayout
from staleflow.runfolder.reader import optional_int, read_summary
from staleflow.runfolder.run_state import CRASHED, FINISHED, STOPPED, RunState, read_state
from staleflow.runfolder.run_summary import RunSummary
from staleflow.runfolder.step_record import RecordError, StepRecord, instance_steps

logger = logging.getLogger(__name__)

_FOLDER_NOTE = (
    "a run folder holds per-step records only: buffers, trajectory-server counts and "
    "instance snapshots are shown while the run is alive (staleflow dashboard --address)"
)
_PS_NOTE = (
    "a run folder records only the PS's latest version per step; versions held, readers, "
    "push/pull sizes are known only while the run is alive"
)


class FolderError(ValueError):
    """The path is not a run folder; the message says what is missing."""


class FolderSource:
    def __init__(self, path: str | Path, *, refresh_s: float = 0.5) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise FolderError(f"{self.path} is not a folder: pass a run folder such as runs/<run>")
        if not RunLayout(self.path).looks_like_a_run():
            raise FolderError(
                f"{self.path} has neither {METRICS} nor {CONFIG}: pass the folder "
                "that staleflow launch printed ('run folder ...')"
            )
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._records: SeqLog[StepRecord] = SeqLog(maxlen=1_000_000)
        self._load: SeqLog[LoadSample] = SeqLog(maxlen=1_000_000)
        self._events: SeqLog[RunEvent] = SeqLog(maxlen=1_000_000)
        self._offset = 0
        self._checked = float("-inf")
        self._bad_lines = 0
        self._prev: StepRecord | None = None
        self._last_pull: dict[int, float] = {}
        self._last_push: float | None = None
        self._summary: RunSummary | None = None
        self._state = RunState("unknown", "not read yet")
        self._config, self._cost_model, self._config_note = read_run_config(self.path)
        self._refresh()

    # -- reading ---------------------------------------------------------------------------

    def _refresh(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._checked < self.refresh_s:
                return
            self._checked = now
            self._read_metrics()
            self._state = read_state(self.path)
            summary = self._summary
            if summary is None or summary.launch != self._state.launch:
                summary = read_summary(self.path)
            # a resumed launch that has not ended cleanly shows no earlier launch's summary
            self._summary = summary if self._state.owns(summary) else None

    def _read_metrics(self) -> None:
        path = self.path / METRICS
        try:
            with path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        # The writer may be mid-line: keep an unfinished last line for the next read.
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            try:
                rec = StepRecord.from_json(line)
            except RecordError:
                # a damaged line costs one chart point, not every request
                self._bad_lines += 1
                continue
            self._add(rec)

    def _add(self, rec: StepRecord) -> None:
        t = rec.elapsed_s
        prev = self._prev
        for row in instance_steps(rec, prev):
            if row.pulled and row.version is not None:
                self._events.append(RunEvent(t, "pull", row.version, row.inst))
                self._last_pull[row.inst] = t
            self._load.append(
                LoadSample(
                    time=t,
                    inst=row.inst,
                    version=row.version,
                    running=None,
                    waiting=None,
                    kv_tokens=None,
                    tokens_per_s=None,
                    busy_ratio=row.busy_ratio,
                )
            )
        ps, ps_before = rec.ps_version, prev.ps_version if prev else None
        if ps is not None and ps_before is not None and ps != ps_before:
            self._events.append(RunEvent(t, "push", ps))
            self._last_push = t
        self._events.append(RunEvent(t, "step", rec.version + 1))
        self._records.append(rec)
        self._prev = rec

    # -- RunSource ----------------------------------------------------------------------

    def info(self) -> RunInfo:
        self._refresh()
        cfg = self._config
        notes = [_FOLDER_NOTE]
        if self._config_note:
            notes.append(self._config_note)
        if self._bad_lines:
            notes.append(f"{self._bad_lines} unreadable lines in metrics.jsonl were skipped")
        rollout = _section(cfg, "rollout")
        return RunInfo(
            kind="folder",
            name=self.path.name,
            clock="wall",
            eta=optional_int(cfg.get("eta")),
            batch_size=optional_int(cfg.get("batch_size")),
            group_size=optional_int(cfg.get("group_size")),
            instances=optional_int(rollout.get("instances")) or len(self._instance_ids()) or None,
            cost_model=cost_model_at(self._cost_model, self._records.last()),
            config=cfg,
            notes=tuple(notes),
        )

    def _instance_ids(self) -> list[int]:
        last = self._records.last()
        return last.instances if last else []

    def live(self) -> LiveView:
        self._refresh()
        last = self._records.last()
        ids = self._instance_ids()
        info_n = optional_int(_section(self._config, "rollout").get("instances"))
        if not ids and info_n:
            ids = list(range(info_n))
        return LiveView(
            buffers=None,
            instances=tuple(
                InstanceDetail(
                    inst=i,
                    version=last.instance_version.get(i) if last else None,
                    snapshot=None,
                    measured_tokens_per_s=None,
                    idle_ratio=last.instance_idle.get(i) if last else None,
                    pending_commands=None,
                    last_cycle_commands=None,
                )
                for i in ids
            ),
            ts=None,
            ps_version=last.ps_version if last else None,
            steps=len(self._records),
            elapsed_s=last.elapsed_s if last else 0.0,
            finished=self._state.kind in (FINISHED, STOPPED, CRASHED),
            cycles=last.cycles if last else None,
            discarded=last.discarded if last else None,
            notes=(_FOLDER_NOTE, f"run {self._state.kind}: {self._state.detail}"),
            phase=self._state.phase,
            state=self._state.kind,
        )

    def records(self, since: int, limit: int) -> Page[StepRecord]:
        self._refresh()
        return self._records.page(since, limit)

    def load(self, since: int, limit: int) -> Page[LoadSample]:
        self._refresh()
        return self._load.page(since, limit)

    def events(self, since: int, limit: int) -> Page[RunEvent]:
        self._refresh()
        return self._events.page(since, limit)

    def ps(self) -> PSView:
        last = self._records.last()
        return PSView(
            latest=last.ps_version if last else None,
            held=None,
            num_slots=optional_int(_section(self._config, "parameter_server").get("num_slots")),
            readers=None,
            pushing=None,
            last_push_s=self._last_push,
            last_pull_s=dict(self._last_pull),
            version_bytes=None,
            notes=(_PS_NOTE,),
        )

    @property
    def summary(self) -> RunSummary | None:
        self._refresh()
        return self._summary

    def act(self, action: str) -> str:
        raise ActionNotSupported("a run folder is read-only: there is nothing to act on")

    def close(self) -> None:
        pass


def _section(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}
