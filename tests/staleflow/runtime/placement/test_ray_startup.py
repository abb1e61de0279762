"""A Ray that does not start (issue 31: its start-up timed out on a loaded machine during
``--resume`` and the launcher printed a raw traceback) ends the launch with the usual
one-line error, fresh or resumed, leaves the run folder as it was, and takes away the
processes ``ray.init`` started before it failed. A local start that times out is tried
again (``LOCAL_START_TRIES``) before that error: a second start usually makes it.

``ray.init`` is replaced by one that raises what Ray 2.60 raises when its raylet misses
the 30 s start-up wait (a bare ``Exception``, ``ray/_private/node.py``)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.cli import main
from staleflow.config import load_config, save_config
from staleflow.recovery import write_checkpoint
from staleflow.runtime.errors import LaunchError
from staleflow.runtime.placement.ray_cluster import LOCAL_START_TRIES, RayCluster
from tests.staleflow.recovery.runs import busy_run

ray = pytest.importorskip("ray")

TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)


@pytest.fixture
def slow_ray(monkeypatch):
    """``ray.init`` starts a child process (as Ray starts its GCS and raylet), then times
    out; the children it left are returned for the test to look at."""
    started: list[subprocess.Popen] = []

    def init(*args, **kwargs):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        raise Exception(TIMEOUT)  # what Ray raises

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def _files(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _failed_cleanly(capsys, started: list[subprocess.Popen]) -> str:
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "staleflow launch failed:" in out and "Ray did not start on this machine" in out, out
    assert "timed out during startup" in out and "retry" in out, out
    assert f"started {LOCAL_START_TRIES} times" in out, out
    assert "Traceback" not in out, out
    assert len(started) == LOCAL_START_TRIES, "a start-up time-out is tried again"
    assert started and all(p.wait(timeout=10) is not None for p in started), "left running"
    return out


def test_a_fresh_launch_whose_ray_times_out_fails_in_one_line(tmp_path, capsys, slow_ray):
    runs = tmp_path / "runs"
    code = main(
        [
            "launch",
            "--no-live",
            "--no-dashboard",
            f"run_dir={runs}",
            "model.preset=micro",
            "model.warmup=false",
            "steps=2",
        ]
    )
    assert code == 1
    _failed_cleanly(capsys, slow_ray)
    assert not runs.exists() or not any(runs.iterdir())  # nothing was made


def test_a_resume_whose_ray_times_out_fails_in_one_line_and_changes_nothing(
    tmp_path, capsys, slow_ray
):
    folder = tmp_path / "runs" / "20261124-000000-eta2"
    folder.mkdir(parents=True)
    config = ["eta=2", "batch_size=2", "group_size=2", "steps=10", "model.preset=micro"]
    save_config(load_config(None, config), folder / "config.yaml")
    (folder / "metrics.jsonl").write_text('{"step": 1.0}\n')

    def trainer_part(path: Path) -> None:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"weights")

    write_checkpoint(folder, busy_run().state([{"step": 1.0}]), trainer=trainer_part)
    before = _files(folder)
    code = main(["launch", "--no-live", "--no-dashboard", "--resume", str(folder)])
    assert code == 1
    _failed_cleanly(capsys, slow_ray)
    assert _files(folder) == before


def test_a_local_start_that_times_out_once_is_started_again(monkeypatch, caplog):
    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception(TIMEOUT)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    cluster = RayCluster.connect("", local_cpus=2)
    assert cluster.started and len(calls) == 2 and calls[0] == calls[1]
    assert "starting it again (2 of 3)" in caplog.text


def test_a_start_that_fails_otherwise_is_not_tried_again(monkeypatch):
    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        raise Exception("the object store needs 2 GB of /dev/shm")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(LaunchError, match="object store") as err:
        RayCluster.connect("", local_cpus=2)
    assert len(calls) == 1 and "started" not in str(err.value)
