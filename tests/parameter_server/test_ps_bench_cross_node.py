"""The cross-node row of experiments/bench_parameter_server.py runs on a Ray cluster of
three raylets on this machine and reports verified Push and Pull figures in its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_parameter_server.py"


@pytest.mark.slow  # two raylets (35 s on CI); test_ps_nixl and test_ps_transport cover the transports
def test_cross_node_row_pushes_over_nixl_or_tcp_and_pulls_over_shm(tmp_path: Path) -> None:
    target = tmp_path / "cross.json"
    args = ["--cross-node", "--skip-pull", "--skip-push", "--size-mib", "4", "--repeats", "2"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(target)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Cross-node (Ray nodes on one host: loopback)" in proc.stdout
    row = json.loads(target.read_text())["cross_node"]
    assert row["one_host"] is True and row["nbytes"] == 4 << 20
    assert row["push_socket"]["transport"] == "socket"
    assert row["push_nixl"]["transport"] in ("nixl", "socket")  # TCP where NIXL cannot start
    assert row["pull_shm"]["transport"] == "shm" and row["pull_shm"]["verified"] is True
    for key in ("push_nixl", "push_socket", "pull_shm"):
        assert row[key]["median_gbps"] > 0
