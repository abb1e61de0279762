"""A real ``staleflow launch`` of the calculator task as a subprocess, for the agentic
recovery tests (``test_chaos_agentic.py``, ``test_resume_same_tokens.py``): its command
line, waiting on its run folder, the crash (SIGKILL of the launcher, then of any actor
Ray's reaper left), and what a checkpoint cut holds of each live trajectory (inside its
tool call, in the middle of a turn)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from staleflow.envs.calculator import calculator_tokenizer
from staleflow.envs.tool_calls import has_tool_call
from staleflow.runfolder.run_state import PAUSE_ENV
from staleflow.runtime.workers.env_stage import turns_of

TIMEOUT_S = 300.0  # per wait: a liveness bound on a loaded machine
TOK = calculator_tokenizer()
T = TypeVar("T")


def calculator_run(policy: Path, eta: int, tool_s: float) -> list[str]:
    """The configuration both tests launch: ``policy`` (``warm_micro_calculator`` with
    256 positions), every tool call taking ``tool_s`` seconds, a cut after every step,
    the audit trail on."""
    return [
        f"eta={eta}",
        "data.task=calculator",
        f"model.checkpoint={policy}",
        # a call, its answer and a last turn: the micro model is warmed with 256 positions
        "rollout.max_response_tokens=220",
        # each instance decodes one trajectory at a time (a turn of about 80 tokens takes
        # about a second), the others wait: the rollout is the slowest stage, so whenever
        # the run is cut, an instance is in the middle of some trajectory's turn
        "rollout.max_running=1",
        # the warmed micro model then nearly always opens its first turn with a tool call
        # (at the default 1.0, 6 of the 24 trajectories of a run here opened one)
        "rollout.temperature=0.5",
        "coordinator.period_s=0.05",
        # every tool call takes tool_s, longer than a turn: the trajectories whose turns
        # ended in the last tool_s seconds are inside their calls
        f"env.latency_scale_s={tool_s:g}",
        f"env.latency_cap_s={tool_s:g}",
        "checkpoint_every=1",
        "recovery.keep=10",
        "recovery.progress_every_s=0.2",
        "recovery.audit_log=true",
        "eval_problems=0",
    ]


def launch(tmp_path: Path, args: list[str], log: str, pauses: str = "") -> subprocess.Popen:
    """``staleflow launch`` with ``args``, its output in ``tmp_path / log``; ``pauses``:
    ``STALEFLOW_TEST_PAUSE_AT`` (``staleflow.runfolder.run_state``)."""
    cmd = [sys.executable, "-m", "staleflow.cli", "launch", "--no-live", "--no-dashboard"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PAUSE_ENV: pauses}
    out = (tmp_path / log).open("w")
    return subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_for(proc: subprocess.Popen, cond: Callable[[], T | None], what: str, log: Path) -> T:
    """``cond()`` once it is truthy; fails the test if the run ends first or it takes
    over ``TIMEOUT_S``."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{tail(log)}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n{tail(log)}")


@contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Kill ``proc`` if it still runs when the block ends (a failed wait)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = 2 * TIMEOUT_S) -> None:
    """Wait for a launch that must exit 0."""
    with reaped(proc):
        assert proc.wait(timeout_s) == 0, tail(log)


def run_folder(proc: subprocess.Popen, runs: Path, log: Path) -> Path:
    """The folder of the one run under ``runs``, once it has a ``live.json``."""
    return wait_for(proc, lambda: next(runs.glob("*/live.json"), None), "the run", log).parent


def in_phase(proc: subprocess.Popen, run_dir: Path, phase: str, log: Path) -> None:
    """Wait until the launcher's ``state.json`` names ``phase``."""
    wait_for(
        proc,
        lambda: (read_json(run_dir / "state.json") or {}).get("phase") == phase,
        f"the {phase} phase",
        log,
    )


def crash(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher (a crash); Ray's reaper takes its actors down with it, and
    the test fails, after killing them, if any outlived it by a minute."""
    actors = dict((read_json(run_dir / "live.json") or {}).get("pids", {}))
    with reaped(proc):
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in actors.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {role: pid for role, pid in actors.items() if _alive(pid)}
    for pid in left.values():
        os.kill(pid, signal.SIGKILL)
    assert not left, f"actors outlived the killed launcher: {left}"


def tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# -- what a cut holds --------------------------------------------------------------------


def saved(ck) -> dict[int, dict]:
    """traj id -> what the cut (a read checkpoint) holds of every live trajectory."""
    t, g = ck.trajectories["trajectories"], ck.trajectories["groups"]
    answers = dict(zip(g["id"].tolist(), g["answer"], strict=True))
    off = t["offsets"]
    return {
        tid: {
            "state": t["state"][k],
            "v_traj": int(t["v_traj"][k]),
            "tokens": t["tokens"][off[k] : off[k + 1]].tolist(),
            "versions": t["versions"][off[k] : off[k + 1]].tolist(),
            "mask": t["mask"][off[k] : off[k + 1]].tolist(),
            "answer": answers[int(t["group"][k])],
        }
        for k, tid in enumerate(t["id"].tolist())
    }


def in_tool_call(s: dict) -> bool:
    """Handed to a reward worker after a model turn that called a tool and ended at its
    end of turn (one cut at the token budget gets no step): in the TS's view, inside its
    tool call (the environment's answer not stored)."""
    spans = turns_of(np.array(s["mask"], bool))
    if s["state"] != "rewarding" or not spans or spans[-1][1] != len(s["tokens"]):
        return False
    if s["tokens"][-1] != TOK.eos_id:
        return False
    a, b = spans[-1]
    return has_tool_call(TOK.decode(np.array(s["tokens"][a:b], np.int32)))


def turn_begun(s: dict) -> bool:
    """A model turn begun and not ended: the last token the TS has is the model's and
    is no end of turn. ``state`` says where it is: ``routed`` on an instance (a live
    cut, as of its last progress report), ``queued`` interrupted (a stop's cut)."""
    return bool(s["tokens"]) and bool(s["mask"][-1]) and s["tokens"][-1] != TOK.eos_id
