"""The benchmark script runs end to end at a tiny size and reports verified numbers."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_parameter_server.py"


def test_help() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--size-mib" in out.stdout and "--json" in out.stdout


def test_small_run_writes_verified_json(tmp_path: Path) -> None:
    target = tmp_path / "ps.json"
    args = ["--size-mib", "4", "--repeats", "2", "--transports", "shm,socket", "--step", "sleep"]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--json", str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "Pull of 4 MiB" in stdout and "exposed per step" in stdout
    assert not glob.glob(f"/dev/shm/staleflow-ps-{proc.pid}-*"), "the benchmark leaked shm"
    result = json.loads(target.read_text())
    for name in ("shm", "socket"):
        row = result["pull"][name]
        assert row["verified"] is True and row["median_gbps"] > 0
        assert row["fraction_of_memcpy"] > 0
    (push,) = result["push_overlap"]
    assert push["push_s"] > 0 and push["exposed_s"] >= 0
