"""Every file of a run folder, named here once (STYLE.md rule 15: one owner per file
format): the rest of the library reaches a run folder's files through :class:`RunLayout`
or these names, never by spelling them.

==================  ====================================================================
``config.yaml``     the resolved launch config (``staleflow.runfolder.writer``)
``metrics.jsonl``   one step record a line (``staleflow.runfolder.step_record``)
``summary.json``    the run's summary, once it ends (``staleflow.runfolder.run_summary``)
``state.json``      the launch's phase and outcome (``staleflow.runfolder.run_state``)
``live.json``       while the run is up: its Ray address and pids (the supervisor)
``audit.jsonl``     with ``recovery.audit_log``: every consumed trajectory
``tracking/``       with ``tracking=...``: the trackers' own files (``staleflow.tracking``)
==================  ====================================================================

Checkpoints keep their own layout (``staleflow.recovery.checkpoint``); the served engines'
model and logs are named by ``staleflow.engines.factory``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from staleflow.runfolder.run_summary import RunSummary

CONFIG, METRICS, SUMMARY = "config.yaml", "metrics.jsonl", "summary.json"
STATE = "state.json"
LIVE = "live.json"
AUDIT = "audit.jsonl"
TRACKING = "tracking"  # a folder: one subfolder per tracker
FILES = (CONFIG, METRICS, SUMMARY, STATE, LIVE, AUDIT, TRACKING)


class RunLayout:
    """The files of the run folder at ``root``; reads and writes ``live.json`` and
    ``summary.json``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def state(self) -> Path:
        return self.root / STATE

    @property
    def live(self) -> Path:
        return self.root / LIVE

    @property
    def audit(self) -> Path:
        return self.root / AUDIT

    def looks_like_a_run(self) -> bool:
        """Whether ``staleflow launch`` has written here (its config or a step record)."""
        return self.metrics.exists() or self.config.exists()

    def write_live(self, info: Mapping[str, Any]) -> None:
        """``live.json``, replaced whole (a reader never sees half of it)."""
        tmp = self.root / f".{LIVE}.tmp"
        tmp.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.live)

    def read_live(self) -> Any:
        """``live.json`` as written; raises ``OSError`` or ``ValueError`` as ``json`` does."""
        return json.loads(self.live.read_text(encoding="utf-8"))

    def remove_live(self) -> None:
        self.live.unlink(missing_ok=True)

    def write_summary(self, summary: RunSummary) -> None:
        """``summary.json``, replaced whole (a reader never sees half of it)."""
        tmp = self.root / f".{SUMMARY}.tmp"
        tmp.write_text(json.dumps(summary.to_json(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.summary)

    def read_summary(self) -> RunSummary | None:
        """``summary.json``, or None while the run is unfinished (or it stopped early, or
        the file is not a JSON object)."""
        try:
            data = json.loads(self.summary.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return None
        return RunSummary.from_json(data) if isinstance(data, dict) else None
