"""A confined call (``staleflow.rewards.confinement``): forked from this process, it runs
with no network, limits, an empty working directory, a scrubbed environment, and is
killed with every process it started. Each test runs the real thing on this kernel;
where the kernel refuses a part, the test of that part skips with the probe's reason,
and ``test_a_refused_namespace_falls_back_and_says_why`` checks the fallback anywhere."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from staleflow.rewards import confinement
from staleflow.rewards.confinement import Limits, call_confined, probe


def _needs(prefix: str) -> None:
    notes = probe()  # decided once per process, by calls that do nothing
    if not any(n.startswith(prefix) for n in notes):
        pytest.skip("not on this machine: " + "; ".join(notes))


def _connect(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return "connected"


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    yield server.getsockname()[1]
    server.close()


def test_a_socket_to_localhost_is_refused_without_the_network(listener) -> None:
    _needs("namespaces: user, network")
    reply = call_confined(_connect, (listener,), Limits(), 10)
    assert reply.status == "error" and "Network is unreachable" in reply.value


def test_a_refused_namespace_falls_back_and_says_why(listener, monkeypatch) -> None:
    # namespaces the kernel refuses (CLONE_PARENT, which unshare never takes): the calls
    # run without, unconfined in the network (the same socket connects), and the notes
    # say why
    monkeypatch.setattr(confinement, "_NAMESPACE_SETS", (("bogus", 0x8000),))
    monkeypatch.setattr(confinement, "_CHOSEN", {})
    limits = Limits(open_files=100)
    flags, notes = confinement.choose_namespaces(limits)
    assert flags == 0
    assert notes[0].startswith("not confined: the network (no namespace: bogus: the sandbox")
    assert "Invalid argument" in notes[0]
    reply = call_confined(_connect, (listener,), limits, 10)
    assert reply.status == "ok" and reply.value == "connected"


def test_a_tool_that_allocates_past_its_memory_is_stopped() -> None:
    reply = call_confined(lambda: len(bytearray(512 << 20)), (), Limits(memory_mb=128), 10)
    assert reply.status == "memory"
    # within its limit the same tool runs
    assert call_confined(lambda: len(bytearray(64 << 20)), (), Limits(memory_mb=128), 10).value


def _alive_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _fork_bomb_then_sleep(marker: str, escape: bool) -> None:
    for _ in range(100):  # as many as the limit lets it start
        try:
            subprocess.Popen(["sleep", marker], start_new_session=escape)
        except OSError:
            break
    time.sleep(600)


@pytest.mark.parametrize("escape", [False, True], ids=["in-its-group", "own-session"])
def test_a_fork_bomb_past_the_limit_is_killed_with_its_children(escape: bool) -> None:
    if escape:  # a child in a session of its own leaves the process group: only the PID
        _needs("namespaces: user, network, PID")  # namespace's end kills it
    marker = f"{1000 + uuid.uuid4().int % 1000}.{os.getpid()}"  # a sleep no one else runs
    reply = call_confined(_fork_bomb_then_sleep, (marker, escape), Limits(processes=8), 1)
    assert reply.status == "timeout"
    deadline = time.monotonic() + 10  # SIGKILL is delivered, not waited for
    while _alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_with(marker) == []


def _count_forks(marker: str) -> int:
    started = []
    for _ in range(64):
        try:
            started.append(subprocess.Popen(["sleep", marker]))
        except OSError:
            break
    return len(started)


def test_the_number_of_processes_is_limited(monkeypatch) -> None:
    if os.geteuid() == 0:  # root is never bound by RLIMIT_NPROC: run the call as nobody,
        # as a root whose Python nobody can read would (this test imports nothing more)
        monkeypatch.setattr(confinement, "_OTHERS_CAN_IMPORT", True)
    marker = f"{2000 + uuid.uuid4().int % 1000}.{os.getpid()}"
    reply = call_confined(_count_forks, (marker,), Limits(processes=8), 20)
    if "processes: at most 8" not in reply.notes:
        pytest.skip("not on this machine: " + "; ".join(reply.notes))
    assert 0 < reply.value < 8  # the call and its warden count too
    assert _alive_with(marker) == []  # and the ones it started are gone with it


def _write(parent_cwd: str) -> dict[str, object]:
    Path("left.txt").write_text("relative")
    try:
        Path(parent_cwd, "absolute.txt").write_text("absolute")
        absolute = "written"
    except OSError as exc:
        absolute = exc.strerror
    return {"cwd": os.getcwd(), "files": os.listdir("."), "absolute": absolute}


def test_a_tool_leaves_no_file_in_the_parents_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    reply = call_confined(_write, (str(tmp_path),), Limits(), 10)
    assert reply.status == "ok"
    assert reply.value["files"] == ["left.txt"]  # an empty directory of its own
    assert reply.value["cwd"] != str(tmp_path) and not Path(reply.value["cwd"]).exists()
    if any(n.startswith("files: read-only") for n in reply.notes):
        assert reply.value["absolute"] == "Read-only file system"
        assert list(tmp_path.iterdir()) == []
    else:  # without a mount namespace a full path reaches the user's files
        assert [p.name for p in tmp_path.iterdir()] == ["absolute.txt"]


def _environment() -> dict[str, object]:
    import ctypes

    start, end = confinement._environ_block()
    return {
        "environ": dict(os.environ),
        "child": subprocess.run(["env"], capture_output=True, text=True).stdout,
        "block": ctypes.string_at(start, end - start).decode(errors="replace"),
    }


def test_the_environment_is_scrubbed(monkeypatch) -> None:
    monkeypatch.setenv("STALEFLOW_TEST_SECRET", "hunter2")
    assert "hunter2" in _environment()["child"]  # unconfined, a child sees it
    reply = call_confined(_environment, (), Limits(), 10)
    assert reply.status == "ok"
    assert set(reply.value["environ"]) == {"PATH", "HOME", "TMPDIR", "LANG"}
    assert "hunter2" not in reply.value["child"]
    assert "hunter2" not in reply.value["block"]  # /proc/self/environ's memory too


def test_an_answer_that_is_not_plain_data_is_an_error() -> None:
    reply = call_confined(lambda: object(), (), Limits(), 10)
    assert reply.status == "error" and "not plain data" in reply.value


def test_a_tool_that_exits_is_an_error_of_its_own() -> None:
    reply = call_confined(lambda: os._exit(3), (), Limits(), 10)
    assert (reply.status, reply.value) == ("died", "exited with code 3 without answering")
    reply = call_confined(lambda: exit(4), (), Limits(), 10)
    assert (reply.status, reply.value) == ("error", "SystemExit(4)")
