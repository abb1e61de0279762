"""``staleflow status`` reads the run's own state (``state.json``, written by the
launcher at every phase and at its end) and tells finished, running, stopped and crashed
runs apart; folders written before the file existed open as before and say so.

The running and SIGKILLed launchers are real processes that write the state with the
launcher's own writer; the finished, stopped and failed ones end it as ``launch`` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from staleflow.cli import main
from staleflow.dashboard.folder_source import FolderSource
from staleflow.runfolder.layout import RunLayout
from staleflow.runfolder.reader import CONFIG, LIVE, METRICS, STATE, SUMMARY
from staleflow.runfolder.run_state import (
    CRASHED,
    FINISHED,
    RUNNING,
    STOPPED,
    UNKNOWN,
    StateWriter,
    _pauses,
    read_state,
)

RECORD = {"step": 1.0, "version": 0.0, "time/elapsed_s": 1.0, "staleness/hist/0": 8.0}


def _folder(tmp_path: Path, name: str, steps: int = 2) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / CONFIG).write_text("eta: 1\nbatch_size: 2\ngroup_size: 4\n")
    lines = [
        json.dumps({**RECORD, "step": float(s + 1), "version": float(s)}) for s in range(steps)
    ]
    (folder / METRICS).write_text("".join(line + "\n" for line in lines))
    return folder


def _summary(folder: Path, steps: int, launch: str | None, stopped: bool = False) -> None:
    data = {"steps": steps, "stopped": stopped, "staleness_hist": {"0": 8 * steps}}
    if launch is not None:
        data["launch"] = launch
    (folder / SUMMARY).write_text(json.dumps(data))


def _status(capsys, folder: Path) -> str:
    assert main(["status", str(folder)]) == 0
    return capsys.readouterr().out


# a launcher process: writes its state with the launcher's writer, then waits or exits
_LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from staleflow.runfolder.run_state import StateWriter
    state = StateWriter(Path(sys.argv[1]), resumed=sys.argv[2] == "resumed")
    state.phase("training")
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _launcher(folder: Path, resumed: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(folder), "resumed" if resumed else "fresh"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_finished_run_is_finished_with_its_summary(tmp_path, capsys):
    folder = _folder(tmp_path, "finished")
    state = StateWriter(folder, resumed=False)
    state.phase("training")
    state.phase("auditing")
    _summary(folder, 2, state.launch)
    state.end(FINISHED)
    got = read_state(folder)
    assert got.kind == FINISHED and got.owns(RunLayout(folder).read_summary())
    source = FolderSource(folder)
    assert source.live().state == FINISHED and source.live().finished
    assert source.summary is not None
    out = _status(capsys, folder)
    assert "finished)" in out and "summary.json" in out


def test_a_running_launcher_is_running_and_a_sigkilled_one_crashed(tmp_path, capsys):
    folder = _folder(tmp_path, "running")
    proc = _launcher(folder)
    try:
        got = read_state(folder)
        assert got.kind == RUNNING and got.phase == "training", got
        assert not FolderSource(folder).live().finished
        assert "running)" in _status(capsys, folder)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    got = read_state(folder)
    assert got.kind == CRASHED and "SIGKILL" in got.detail, got
    assert "crashed)" in _status(capsys, folder)


def test_a_sigkilled_resume_does_not_show_the_earlier_launchs_summary(tmp_path, capsys):
    """Issue 31: a SIGKILLed resume showed 'finished' with the previous run's summary."""
    folder = _folder(tmp_path, "resumed", steps=5)
    _summary(folder, 3, launch="earlier", stopped=True)
    proc = _launcher(folder, resumed=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    got = read_state(folder)
    assert got.kind == CRASHED, got
    source = FolderSource(folder)
    assert source.summary is None and source.live().state == CRASHED
    out = _status(capsys, folder)
    assert "crashed)" in out and "summary.json" not in out, out


def test_a_stopped_run_is_stopped_and_names_the_resume(tmp_path, capsys):
    folder = _folder(tmp_path, "stopped")
    state = StateWriter(folder, resumed=False)
    state.phase("training")
    _summary(folder, 2, state.launch, stopped=True)
    state.end(STOPPED, "a signal asked it to stop")
    got = read_state(folder)
    assert got.kind == STOPPED and "--resume" in got.detail, got
    assert "stopped)" in _status(capsys, folder)


def test_a_launch_that_raised_crashed_with_its_reason(tmp_path, capsys):
    folder = _folder(tmp_path, "raised")
    state = StateWriter(folder, resumed=False)
    state.phase("training")
    state.end(CRASHED, "LaunchError: the trainer stopped: out of memory")
    got = read_state(folder)
    assert got.kind == CRASHED and "out of memory" in got.detail, got
    assert "crashed)" in _status(capsys, folder)


def test_a_reused_pid_is_not_the_launcher(tmp_path):
    folder = _folder(tmp_path, "reused")
    StateWriter(folder, resumed=False).phase("training")  # this very process: alive
    raw = json.loads((folder / STATE).read_text())
    assert read_state(folder).kind == RUNNING
    if raw["pid_start"] is None:
        pytest.skip("no /proc here: a pid's start time cannot be read")
    raw["pid_start"] += 1  # another process now has this pid
    (folder / STATE).write_text(json.dumps(raw))
    assert read_state(folder).kind == CRASHED


def test_another_hosts_launcher_is_unknown(tmp_path):
    folder = _folder(tmp_path, "elsewhere")
    StateWriter(folder, resumed=False).phase("training")
    raw = json.loads((folder / STATE).read_text())
    (folder / STATE).write_text(json.dumps({**raw, "host": "some-other-node"}))
    got = read_state(folder)
    assert got.kind == UNKNOWN and "some-other-node" in got.detail


def test_folders_written_before_state_json_open_as_before(tmp_path, capsys):
    finished = _folder(tmp_path, "old-finished")
    _summary(finished, 2, launch=None)
    assert read_state(finished).kind == FINISHED
    assert FolderSource(finished).summary is not None
    assert "before" in read_state(finished).detail
    stopped = _folder(tmp_path, "old-stopped")
    _summary(stopped, 2, launch=None, stopped=True)
    assert read_state(stopped).kind == STOPPED
    gone = _folder(tmp_path, "old-crashed")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (gone / LIVE).write_text(json.dumps({"driver_pid": dead.pid, "pids": {}}))
    assert read_state(gone).kind == CRASHED
    bare = _folder(tmp_path, "old-bare")
    got = read_state(bare)
    assert got.kind == UNKNOWN and "before" in got.detail
    assert "unknown)" in _status(capsys, bare)


def test_the_test_pause_takes_phases_and_seconds():
    assert _pauses("finishing:8, auditing:2.5") == {"finishing": 8.0, "auditing": 2.5}
    assert _pauses("") == {} and _pauses("bad") == {}
