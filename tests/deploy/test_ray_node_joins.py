"""A raylet started the documented way joins a Ray head that requires token
authentication (Ray >= 2.59), on 127.0.0.1: both with ``deploy/ray-node``, the script the
SLURM job and docs/cluster.md use (a raylet started without ``RAY_AUTH_MODE=token``,
as deploy/ used to, never joined such a head).

Its own temp dir, token file and ports; cleanup ends only the processes it started (their
process groups, and any left whose command line names its temp dir), never another
Ray on the machine (no ``ray stop``, which stops every Ray of the user)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
RAY_NODE = ROOT / "deploy" / "ray-node"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_ports() -> list[str]:
    names = (
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
    )
    ports = _free_ports(len(names) + 1)
    low = 20000 + ports[-1] % 20000  # a worker-port range of its own
    return [f"--{name}={port}" for name, port in zip(names, ports, strict=False)] + [
        f"--min-worker-port={low}",
        f"--max-worker-port={low + 40}",
    ]


def _wait_for_nodes(address: str, want: int, env: dict[str, str], timeout_s: float) -> int:
    """Alive nodes of the cluster once ``want`` are (or at the deadline), asked by one
    client process (importing ray takes seconds here)."""
    code = f"""
import json, time, ray
ray.init(address={address!r}, logging_level="ERROR")
deadline = time.monotonic() + {timeout_s}
while True:
    alive = len([n for n in ray.nodes() if n["Alive"]])
    if alive >= {want} or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(alive))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port} after {timeout_s} s"
            time.sleep(0.3)


def _end(procs: list[subprocess.Popen], temp_dir: str) -> None:
    import psutil

    for proc in procs:  # `ray start --block` stops its node's processes on SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the rest of its own process group
    # Ray daemons that left the process group: only those of this test's session
    for p in psutil.process_iter(["pid", "cmdline"]):
        if temp_dir in " ".join(p.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.slow  # a Ray head and a raylet (35 s on CI)
def test_a_raylet_started_the_documented_way_joins_a_token_auth_head():
    temp_dir = tempfile.mkdtemp(prefix="sfray-", dir="/tmp")  # short: socket paths
    token = Path(temp_dir) / "token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # the venv's `ray` first; the token file of this test, not ~/.ray/auth_token
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    (gcs_port,) = _free_ports(1)
    address = f"127.0.0.1:{gcs_port}"
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", "--block"]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    str(RAY_NODE),
                    "head",
                    f"--port={gcs_port}",
                    f"--temp-dir={temp_dir}",
                    "--include-dashboard=false",
                    "--disable-usage-stats",
                    f"--ray-client-server-port={_free_ports(1)[0]}",
                    *common,
                    *_node_ports(),
                ],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait_for_port(gcs_port, 60)
        procs.append(
            subprocess.Popen(
                [str(RAY_NODE), "join", address, *common, *_node_ports()],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        assert token.read_text().strip(), "the head wrote no token"
        client = {**env, "RAY_AUTH_MODE": "token"}  # what docs/cluster.md has a client set
        nodes = _wait_for_nodes(address, 2, client, timeout_s=60)
        assert procs[0].poll() is None and procs[1].poll() is None, "a node exited"
        assert nodes == 2, f"{nodes} node(s) after 60 s: the raylet never joined"
    finally:
        _end(procs, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
