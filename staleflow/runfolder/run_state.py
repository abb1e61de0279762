"""The run's own state in its folder, ``state.json``: which launch last wrote the folder,
where it runs (host, process id and that process's start time), its phase, and how it
ended. ``staleflow status`` and the dashboard read it (:func:`read_state`) to tell a
finished, running, stopped and crashed run apart, where the existence of
``summary.json`` said only that some launch once reached its end.

- ``finished``: the launch took its step count and wrote ``summary.json``;
- ``stopped``: Ctrl-C or SIGTERM, checkpointed: ``staleflow launch --resume`` goes on;
- ``running``: the launcher has not ended and its process is alive on this machine;
- ``crashed``: the launch raised, or its process is gone without a clean end (SIGKILL,
  the machine lost): resume from the newest checkpoint;
- ``unknown``: launched on another machine, whose process cannot be looked at from here.

The launcher (:class:`StateWriter`) replaces the file atomically at every phase. Folders
written before the file existed are read as before (``summary.json``, and ``live.json``'s
driver process), and say so. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from staleflow.runfolder.layout import LIVE, STATE, SUMMARY, RunLayout
from staleflow.runfolder.reader import read_summary
from staleflow.runfolder.run_summary import RunSummary

logger = logging.getLogger(__name__)

FINISHED, RUNNING, STOPPED, CRASHED, UNKNOWN = (
    "finished",
    "running",
    "stopped",
    "crashed",
    "unknown",
)
# tests only: "<phase>:<seconds>[,...]" holds the launcher that long once it enters a phase,
# so that a chaos test can kill actors exactly during, e.g., the end-of-run audit
PAUSE_ENV = "STALEFLOW_TEST_PAUSE_AT"
_BEFORE = "written before StaleFlow recorded the run's state in state.json"


@dataclass(frozen=True, slots=True)
class RunState:
    kind: str  # FINISHED | RUNNING | STOPPED | CRASHED | UNKNOWN
    detail: str  # one line: what is known and what to do
    phase: str | None = None  # the launcher's last phase (starting, training, ...)
    launch: str | None = None  # the launch that last wrote the folder (None: before)

    def owns(self, summary: RunSummary | None) -> bool:
        """``summary`` was written by the launch the state describes (a resumed launch
        that crashed leaves the summary of the launch before it)."""
        if summary is None:
            return False
        if self.launch is None:  # an older folder: the summary is all there is
            return True
        return summary.launch == self.launch and self.kind in (FINISHED, STOPPED)


# -- writing --------------------------------------------------------------------------------


class StateWriter:
    """``state.json`` of one launch; every write replaces the file whole."""

    def __init__(self, folder: Path, *, resumed: bool) -> None:
        self.path = folder / STATE
        self.launch = uuid.uuid4().hex[:12]
        pid = os.getpid()
        self._data: dict[str, Any] = {
            "format": 1,
            "launch": self.launch,
            "host": socket.gethostname(),
            "pid": pid,
            "pid_start": _start_ticks(pid),
            "started_at": _now(),
            "resumed": resumed,
            "phase": None,
            "outcome": None,
        }
        self._pauses = _pauses(os.environ.get(PAUSE_ENV, ""))

    def phase(self, phase: str) -> None:
        self._data.update(phase=phase, at=_now())
        self._write()
        pause = self._pauses.pop(phase, 0.0)
        if pause > 0:
            logger.warning("pausing %g s in phase %s (%s)", pause, phase, PAUSE_ENV)
            time.sleep(pause)

    def end(self, outcome: str, detail: str = "") -> None:
        """``outcome``: FINISHED, STOPPED or CRASHED (``detail``: why, for a crash)."""
        self._data.update(outcome=outcome, detail=detail, ended_at=_now())
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(f".{STATE}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps(self._data, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _pauses(spec: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        phase, _, seconds = item.partition(":")
        try:
            out[phase] = float(seconds)
        except ValueError:
            logger.warning("%s: ignoring %r (want <phase>:<seconds>)", PAUSE_ENV, item)
    return out


# -- reading --------------------------------------------------------------------------------


def read_state(folder: Path) -> RunState:
    """The state of the run in ``folder`` (see the module docstring)."""
    try:
        raw = json.loads((folder / STATE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _inferred(folder)
    except (OSError, ValueError) as exc:
        return RunState(UNKNOWN, f"{STATE} is unreadable ({exc})")
    if not isinstance(raw, dict):
        return RunState(UNKNOWN, f"{STATE} is not a JSON object")
    phase, launch = raw.get("phase"), raw.get("launch")
    where = f"pid {raw.get('pid')} on {raw.get('host')}"
    outcome = raw.get("outcome")
    if outcome == FINISHED:
        return RunState(FINISHED, f"ended at {raw.get('ended_at')}", phase, launch)
    if outcome == STOPPED:
        detail = f"stopped at {raw.get('ended_at')} ({raw.get('detail') or 'a signal'})"
        return RunState(
            STOPPED, f"{detail}; resume with `staleflow launch --resume {folder}`", phase, launch
        )
    if outcome == CRASHED:
        detail = f"the launch failed in phase {phase}: {raw.get('detail') or 'no reason'}"
        return RunState(CRASHED, f"{detail}; resume from its newest checkpoint", phase, launch)
    alive = _alive(raw.get("pid"), raw.get("host"), raw.get("pid_start"))
    if alive is None:
        return RunState(
            UNKNOWN,
            f"launched on {raw.get('host')} ({where}), which cannot be looked at "
            f"from this machine; its last phase: {phase}",
            phase,
            launch,
        )
    if alive:
        return RunState(RUNNING, f"{where}, phase {phase}", phase, launch)
    return RunState(
        CRASHED,
        f"the launcher ({where}) is gone without a clean end (killed, e.g. SIGKILL, or its "
        f"machine lost) in phase {phase}; resume from its newest checkpoint",
        phase,
        launch,
    )


def _inferred(folder: Path) -> RunState:
    """A folder without ``state.json``: what ``summary.json`` and ``live.json`` say."""
    summary = read_summary(folder)
    if summary is not None:
        kind = STOPPED if summary.stopped else FINISHED
        return RunState(kind, f"from its {SUMMARY} ({_BEFORE})")
    try:
        pid = RunLayout(folder).read_live().get("driver_pid")
    except (OSError, ValueError, AttributeError):
        pid = None
    if isinstance(pid, int):
        if _alive(pid, socket.gethostname(), None):
            return RunState(RUNNING, f"pid {pid}, from its {LIVE} ({_BEFORE})")
        return RunState(CRASHED, f"its launcher (pid {pid}, {LIVE}) is gone ({_BEFORE})")
    return RunState(
        UNKNOWN,
        f"no {SUMMARY}: running, crashed or stopped before it ended cannot be told apart "
        f"({_BEFORE})",
    )


def _alive(pid: object, host: object, start: object) -> bool | None:
    """Whether process ``pid`` of ``host`` is still the one that wrote the state (None:
    another host's). A recorded start time tells a reused pid apart."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    fields = _stat(pid)
    if fields and fields[0] == "Z":  # exited, not yet reaped by its parent
        return False
    if isinstance(start, int) and fields:
        return _ticks(fields) in (None, start)
    return True


def _stat(pid: int) -> list[str]:
    """The fields of Linux's ``/proc/<pid>/stat`` after the command name (which may
    hold spaces); [] elsewhere."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return []


def _ticks(fields: list[str]) -> int | None:
    try:
        return int(fields[19])  # field 22: the start time, in clock ticks since boot
    except (IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    return _ticks(_stat(pid))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
