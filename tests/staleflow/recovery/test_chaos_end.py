"""Kills that land at the end of a real run (docs/recovery.md): a rollout instance, the
reward worker and the PS actor SIGKILLed at a chosen step, the last one included, and
during the end-of-run checkpoint and audit, when the control loop no longer looks at
the instances and the supervisor no longer ticks (issue 31: a lost instance there made
the audit call a dead actor, and the launch exited 1 without a summary).

The launcher is held a few seconds as it enters a phase (``STALEFLOW_TEST_PAUSE_AT``,
``staleflow.runfolder.run_state``) and the kill is sent when its ``state.json`` names that
phase, so the overlap is certain rather than lucky. Every run must end with exit 0, a
``summary.json`` whose audit balances (every trajectory created is consumed, aborted,
queued or completed; none routed, rewarding or on an instance), every PS replica at
the last version, every consumed trajectory and token within eta, none trained twice,
and ``state.json`` saying finished.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from staleflow.runfolder.layout import RunLayout
from staleflow.runfolder.run_state import FINISHED, PAUSE_ENV, read_state
from staleflow.runtime.workers.audit_trail import read_audit
from tests.staleflow.runtime.driver.launch_checks import MICRO_RUN

pytestmark = pytest.mark.ray

ETA = 1
STEPS = 5
PAUSE_S = 8  # the launcher waits this long in each paused phase: the kills land in it
RUN = [
    *MICRO_RUN,
    f"eta={ETA}",
    f"steps={STEPS}",
    "recovery.progress_every_s=0.2",
    "recovery.audit_log=true",
    "eval_problems=0",
]
TIMEOUT_S = 240.0
KINDS = ("instance/1", "reward/0", "ps/0")


def _launch(tmp_path: Path, pauses: str, log: str) -> tuple[subprocess.Popen, Path]:
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "staleflow.cli", "launch", "--no-live", "--no-dashboard"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PAUSE_ENV: pauses}
    out = (tmp_path / log).open("w")
    proc = subprocess.Popen(
        [*cmd, f"run_dir={runs}", *RUN], stdout=out, stderr=subprocess.STDOUT, env=env
    )
    return proc, runs


def _wait(proc: subprocess.Popen, cond, what: str, log: Path):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{_tail(log)}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n{_tail(log)}")


def _tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _phase(run_dir: Path) -> str | None:
    return (_json(run_dir / "state.json") or {}).get("phase")


def _steps(run_dir: Path) -> int:
    try:
        return sum(1 for _ in (run_dir / "metrics.jsonl").open())
    except OSError:
        return 0


def _kill(run_dir: Path, role: str) -> int:
    pid = _json(run_dir / "live.json")["pids"][role]
    os.kill(pid, signal.SIGKILL)
    return pid


def _run_with_kills(tmp_path: Path, at: dict[str, int | str], log: str) -> Path:
    """Launch; SIGKILL each role of ``at`` at its step (an int: once that many records
    are in metrics.jsonl) or phase ("finishing": the last step trained, before the final
    checkpoint; "auditing": the end-of-run audit); return the run folder once the run
    exited 0."""
    pauses = ",".join(
        f"{p}:{PAUSE_S}" for p in sorted({v for v in at.values() if isinstance(v, str)})
    )
    proc, runs = _launch(tmp_path, pauses, log)
    path = tmp_path / log
    try:
        run_dir = _wait(proc, lambda: next(runs.glob("*/live.json"), None), "the run", path).parent
        order = sorted(at.items(), key=lambda kv: _order(kv[1]))
        for role, when in order:
            if isinstance(when, int):
                _wait(proc, lambda w=when: _steps(run_dir) >= w, f"step {when}", path)
            else:
                _wait(proc, lambda w=when: _phase(run_dir) == w, f"phase {when}", path)
            _kill(run_dir, role)
        assert proc.wait(TIMEOUT_S) == 0, _tail(path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return run_dir


def _order(when: int | str) -> tuple[int, int]:
    return (0, when) if isinstance(when, int) else (1, ["finishing", "auditing"].index(when))


def _check_end(run_dir: Path) -> dict:
    """What every run must show at its end, from the run folder alone."""
    summary = _json(run_dir / "summary.json")
    assert summary is not None, "no summary.json"
    audit = summary["audit"]
    assert audit["routed"] == 0 and audit["rewarding"] == 0 and audit["on_instances"] == 0, audit
    assert audit["created"] == (
        audit["consumed"] + audit["aborted"] + audit["queued"] + audit["completed"]
    ), audit
    assert set(audit["ps_latest"].values()) == {STEPS}, audit
    assert summary["steps"] == STEPS and summary["staleness_max"] <= ETA, summary
    consumed = read_audit(run_dir / "audit.jsonl")
    assert len(consumed) == audit["consumed"] == 2 * 4 * STEPS  # batch x group per step
    assert max(Counter(a["traj_id"] for a in consumed).values()) == 1, "trained twice"
    for a in consumed:
        assert 0 <= a["version"] - a["v_traj"] <= ETA, a
        assert all(a["v_traj"] <= v <= a["version"] for v in a["versions"]), a
    state = read_state(run_dir)
    assert state.kind == FINISHED and state.owns(RunLayout(run_dir).read_summary()), state
    return audit


# a liveness bound, not a timing check (90 to 110 s here on 2 shared, busy cores)
@pytest.mark.timeout(900)
def test_kills_during_the_final_checkpoint_and_the_audit_end_in_a_balanced_summary(tmp_path):
    at: dict[str, int | str] = {
        "instance/0": "finishing",  # the last step is trained; the final cut comes next
        "ps/0": "finishing",
        "instance/1": "auditing",  # the control loop has stopped looking at instances
        "reward/0": "auditing",
    }
    run_dir = _run_with_kills(tmp_path, at, "end.log")
    audit = _check_end(run_dir)
    seen = audit["recovery"]
    assert seen.get("instance_lost", 0) >= 2, seen  # both, found by the loop and the audit
    assert seen.get("reward_worker_lost", 0) >= 1 and seen.get("ps_lost", 0) >= 1, seen
    live = _json(run_dir / "live.json")
    assert live is None  # the launcher took it away at its end


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kills_at_random_steps_the_last_included_end_in_a_balanced_summary(tmp_path, seed):
    rng = random.Random(seed)
    at: dict[str, int | str] = {}
    for role in KINDS:  # steps 2..STEPS, or the end-of-run phases after the last step
        when = rng.choice([*range(2, STEPS + 1), "finishing", "auditing"])
        at[role] = when
    _check_end(_run_with_kills(tmp_path, at, f"seed{seed}.log"))
