"""`staleflow launch` shows every wait before training, the way a user sees it: run as a
subprocess once with its output in a pseudo-terminal (live bars) and once into a pipe
(plain lines, as in a log or under nohup), on a micro model with a short warm-up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 900  # a liveness bound: seconds of work, minutes on a machine at load 30
pytestmark = [pytest.mark.ray, pytest.mark.timeout(TIMEOUT_S + 60)]

ROOT = Path(__file__).resolve().parents[4]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _command(tmp_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "staleflow.cli",
        "launch",
        "--eta",
        "1",
        "--steps",
        "2",
        "--no-dashboard",
        "model.preset=micro",
        "model.warmup_steps=30",
        "model.warmup_target=0",
        f"model.cache_dir={tmp_path / 'cache'}",  # a first run: the warm-up happens
        f"run_dir={tmp_path / 'runs'}",
        "eval_problems=16",
        "batch_size=2",
        "group_size=4",
        "rollout.max_response_tokens=8",
        "coordinator.period_s=0.05",
    ]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "160", "TERM": "xterm"}


@pytest.mark.slow  # a launch to watch its waits (55-75 s on CI)
def test_a_log_gets_a_line_for_each_wait_as_it_starts_and_ends(tmp_path):
    done = subprocess.run(
        _command(tmp_path),
        env=_env(),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()

    def index(prefix: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert found, f"no line starts with {prefix!r}:\n{done.stdout}"
        return found[0]

    order = [
        index("warming up the built-in micro model ... (30 steps)"),
        index("warming up the built-in micro model: done in"),
        index("scoring the initial policy on held-out problems ... (16 problems)"),
        index("scoring the initial policy on held-out problems: done in"),
        index("starting actors: 2 rollout, 1 reward, trainer, TS, 1 PS, control ... (5 stages)"),
        index("starting actors: 2 rollout, 1 reward, trainer, TS, 1 PS, control: done in"),
        index("waiting for the first buffer ... (2 groups)"),
        index("waiting for the first buffer: done in"),
        index("step    1 "),
    ]
    assert order == sorted(order), done.stdout
    assert "30/30 steps, loss " in lines[order[1]]
    assert "5/5 stages" in lines[order[5]]
    assert not ANSI.search(done.stdout), "terminal control codes in a log"


@pytest.mark.slow  # a launch to watch its waits (55-75 s on CI)
def test_a_terminal_gets_live_bars_for_each_wait(tmp_path):
    controller, terminal = os.openpty()
    proc = subprocess.Popen(
        _command(tmp_path),
        env=_env(),
        cwd=tmp_path,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        close_fds=True,
    )
    os.close(terminal)
    chunks: list[bytes] = []
    try:
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    shown = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r", "\n")
    drawn = [line for line in shown.splitlines() if "━" in line]  # bars of running phases

    def bar(label: str, count: str) -> None:
        assert any(label in line and count in line and "elapsed" in line for line in drawn), (
            f"no live bar for {label!r} showing {count!r}:\n{shown[-4000:]}"
        )

    bar("warming up the built-in micro model", "/30 steps")
    bar("scoring the initial policy", "/16 problems")
    bar("starting actors", "/5 stages")
    bar("waiting for the first buffer", "/2 groups")
    assert "warming up the built-in micro model: done in" in shown
    assert "step    1 " in shown and "run summary (eta=1)" in shown
