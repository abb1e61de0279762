"""Transports against a real worker process: shm and socket, errors, cleanup, fallback."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from parameter_server import transport as transport_pkg
from parameter_server.errors import (
    DestinationError,
    LayoutMismatchError,
    PushVersionError,
    TransportUnavailableError,
    VersionNotHeldError,
)
from parameter_server.layout import Layout, ParamSpec
from parameter_server.transport import connect
from parameter_server.transport.base import ControlClient, Endpoint
from parameter_server.transport.shm import ShmTransport
from parameter_server.transport.socket import SocketTransport
from parameter_server.worker import PSWorker

WeightsFactory = Callable[[float], dict[str, np.ndarray]]


def content(t, version: int | None = None) -> tuple[int, bytes]:
    dest = np.empty(t.layout.nbytes, np.uint8)
    got = t.pull(dest, version)
    return got, dest.tobytes()


@pytest.mark.parametrize("name", ["shm", "socket"])
def test_push_and_pull_across_processes(worker: PSWorker, make_weights: WeightsFactory, name):
    with connect(worker.endpoint, name) as t:
        assert t.name == name
        latest = t.info().latest
        weights = make_weights(11)
        version = t.push(weights)
        assert version == (0 if latest is None else latest + 1)
        dest = np.zeros(t.layout.nbytes, np.uint8)
        assert t.pull(dest) == version
        for key, view in t.layout.views(dest).items():
            np.testing.assert_array_equal(view, weights[key])
        info = t.info()
        assert version in info.held
        assert info.version_bytes == t.layout.nbytes  # what one Push or whole Pull moves


def test_every_transport_satisfies_the_contract(worker: PSWorker, layout: Layout) -> None:
    from parameter_server.store import VersionedStore
    from parameter_server.transport.base import Transport
    from parameter_server.transport.local import LocalTransport

    local = LocalTransport(VersionedStore(layout))
    for t in (local, connect(worker.endpoint, "shm"), connect(worker.endpoint, "socket")):
        with t:
            assert isinstance(t, Transport)
            assert t.layout == layout and isinstance(t.name, str)
            assert t.info().num_slots == 3


def test_socket_transport_over_tcp(layout: Layout, make_weights: WeightsFactory) -> None:
    with PSWorker.start(layout, address="tcp:127.0.0.1:0") as w:
        assert w.endpoint.address.startswith("tcp:127.0.0.1:")
        with connect(w.endpoint, "socket") as t:
            weights = make_weights(6)
            assert t.push(weights) == 0
            assert content(t)[0] == 0
            dest = np.zeros(t.layout.nbytes, np.uint8)
            t.pull_slices(dest, [t.layout.slice("embed")], 0)
            np.testing.assert_array_equal(t.layout.views(dest)["embed"], weights["embed"])
            assert (t.layout.views(dest)["steps"] == 0).all()


def test_auto_picks_shared_memory_on_the_same_host(worker: PSWorker) -> None:
    with connect(worker.endpoint) as t:
        assert isinstance(t, ShmTransport)


# Shared by the writer (this process) and a reader process: how many Pushes have started
# and finished. A Pull that read `finished` = f before it began and `started` = s after it
# ended overlapped a Push when s > f: Push f + 1 started before the Pull ended and had not
# finished when it began.
OVERLAPPING_READS = 20  # what the reader must see before it stops
DISTINCT_VERSIONS = 5


def _reader(
    endpoint: Endpoint, name: str, started: Any, finished: Any, ready: Any, done: Any, out: Any
) -> None:
    failures, versions, overlapping = [], set(), 0
    try:
        with connect(endpoint, name) as t:
            dest = np.empty(t.layout.nbytes, np.uint8)
            ready.set()
            while overlapping < OVERLAPPING_READS or len(versions) < DISTINCT_VERSIONS:
                before = finished.value
                v = t.pull(dest)
                overlapping += started.value > before
                big = t.layout.views(dest)["big"]
                if not (big == v).all():
                    failures.append(v)
                versions.add(v)
    finally:
        done.set()
        out.put((failures, sorted(versions), overlapping))


@pytest.mark.parametrize("name", ["shm", "socket"])
def test_a_reader_process_never_sees_a_mix_while_the_writer_pushes(name: str) -> None:
    """Reads and Pushes provably overlap (counted, not hoped for from timing): the writer
    starts once the reader is connected and pushes until the reader has made
    OVERLAPPING_READS Pulls during a Push, so a busy machine only makes it take longer."""
    layout = Layout([ParamSpec("big", (1 << 20,), "int32")])
    ctx = mp.get_context("spawn")
    started, finished = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)
    ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    with PSWorker.start(layout, num_slots=3) as w, connect(w.endpoint, "shm") as writer:
        writer.push({"big": np.zeros(1 << 20, np.int32)})
        reader = ctx.Process(
            target=_reader, args=(w.endpoint, name, started, finished, ready, done, out)
        )
        reader.start()
        try:
            while not (ready.wait(0.05) or done.is_set()):  # connected, or failed to
                pass
            v = 0
            while not done.is_set():
                v += 1
                started.value = v
                writer.push({"big": np.full(1 << 20, v, np.int32)})
                finished.value = v
            failures, versions, overlapping = out.get()
        finally:
            reader.join(60)  # it stops by itself once done is set; this is for a failure
            if reader.is_alive():
                reader.kill()
        assert reader.exitcode == 0, f"the reader process failed (exit code {reader.exitcode})"
    assert not failures, f"mixed versions seen: {failures[:5]}"
    assert overlapping >= OVERLAPPING_READS, f"only {overlapping} Pulls overlapped a Push"
    assert len(versions) >= DISTINCT_VERSIONS, versions


def test_bad_requests_leave_the_worker_unchanged(worker: PSWorker, make_weights) -> None:
    with connect(worker.endpoint, "shm") as t, connect(worker.endpoint, "socket") as s:
        t.push(make_weights(1))
        before = (t.info(), content(t))
        held = before[0].held
        for client in (t, s):
            with pytest.raises(VersionNotHeldError, match=r"held: \[") as err:
                client.pull(np.empty(t.layout.nbytes, np.uint8), max(held) + 5)
            assert err.value.held == held
            with pytest.raises(DestinationError):
                client.pull(np.empty(t.layout.nbytes + 8, np.uint8))
            bad = make_weights(2)
            bad["embed"] = bad["embed"][:3]
            with pytest.raises(LayoutMismatchError):
                client.push(bad)
            with pytest.raises(PushVersionError, match="next"):
                client.push(make_weights(2), before[0].latest)
        assert (t.info(), content(t)) == before


def _until(condition: Callable[[], bool]) -> None:
    """Ask the worker (another process: nothing to wait on but its answers) until
    ``condition`` holds; pytest's timeout stops a worker that never gets there."""
    while not condition():
        time.sleep(0.01)


def test_a_dead_reader_releases_its_lease(worker: PSWorker, make_weights) -> None:
    with connect(worker.endpoint, "shm") as t:
        t.push(make_weights(3))
        control = ControlClient(worker.endpoint)
        control.acquire_read(None)
        assert sum(t.info().readers) == 1
        control.close()  # dies without releasing
        _until(lambda: sum(t.info().readers) == 0)


def test_a_dead_writer_leaves_the_latest_version_intact(worker: PSWorker, make_weights) -> None:
    with connect(worker.endpoint, "shm") as t:
        t.push(make_weights(4))
        before = content(t)
        control = ControlClient(worker.endpoint)
        control.begin_push(None)
        control.close()  # dies mid-Push
        _until(lambda: not t.info().pushing)
        assert content(t) == before
        assert t.push(make_weights(5)) == before[0] + 1


def test_shm_refuses_a_worker_on_another_host(worker: PSWorker) -> None:
    elsewhere = dataclasses.replace(worker.endpoint, boot_id="another-machine")
    with pytest.raises(TransportUnavailableError, match="nixl"):
        ShmTransport(elsewhere)


def test_missing_nixl_falls_back_with_one_warning(
    worker: PSWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)  # `import nixl` now raises ImportError
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.setattr(transport_pkg, "_warned_nixl", False)
    elsewhere = dataclasses.replace(worker.endpoint, boot_id="another-machine")
    with caplog.at_level(logging.WARNING, logger="parameter_server.transport"):
        first = connect(worker.endpoint, "nixl")
        second = connect(elsewhere, "nixl")
        third = connect(elsewhere, "auto")
    try:
        assert isinstance(first, ShmTransport)
        assert isinstance(second, SocketTransport) and isinstance(third, SocketTransport)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "NIXL" in warnings[0].getMessage()
    finally:
        for t in (first, second, third):
            t.close()


def test_unknown_transport_name(worker: PSWorker) -> None:
    with pytest.raises(ValueError, match="choose one of"):
        connect(worker.endpoint, "carrier-pigeon")


def test_stop_frees_shared_memory_even_after_a_crash(layout: Layout) -> None:
    w = PSWorker.start(layout, num_slots=2)
    region = os.path.join("/dev/shm", w.endpoint.region_name)
    assert os.path.exists(region)
    assert w.pid is not None
    os.kill(w.pid, signal.SIGKILL)
    w.stop()
    assert not os.path.exists(region)
    assert not os.path.exists(w.endpoint.address.removeprefix("unix:"))
