"""Serving over a real socket: start in a thread, answer, stop; a taken port is a clear
error in the caller."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("uvicorn")

from staleflow.dashboard.app import create_app
from staleflow.dashboard.server import bind, serve_in_thread
from tests.staleflow.dashboard.fakes import FakeSource


def test_serves_on_localhost_and_stops():
    server = serve_in_thread(create_app(FakeSource()), "127.0.0.1", 0)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url + "api/run", timeout=10) as r:
            assert json.load(r)["name"] == "fake-run"
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "healthz", timeout=2)


def test_a_taken_port_names_the_fix():
    taken = bind("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match="pick another port"):
            bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


def test_a_taken_preferred_port_falls_back_to_a_free_one():
    from staleflow.dashboard.server import bind_preferred

    taken = bind("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        server = serve_in_thread(create_app(FakeSource()), "127.0.0.1", port, fallback=True)
        try:
            assert server.port != port
            with urllib.request.urlopen(server.url + "api/run", timeout=10) as r:
                assert json.load(r)["name"] == "fake-run"
        finally:
            server.stop()
        free = bind_preferred("127.0.0.1", port)
        assert free.getsockname()[1] not in (0, port)
        free.close()
    finally:
        taken.close()


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_a_port_out_of_range_is_an_oserror_naming_the_range(port):
    with pytest.raises(OSError, match=r"1\.\.65535"):
        bind("127.0.0.1", port)
