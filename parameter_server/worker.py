"""A PS worker in its own process (multiprocessing, spawn).

The child owns a pre-faulted shared-memory region holding the store's slots,
optionally registers it with NIXL, and serves Pulls and Pushes over a control
socket until the parent stops it or dies. The parent keeps a :class:`PSWorker`
handle: its picklable :attr:`PSWorker.endpoint` is what other processes
connect to. A Ray actor can wrap the same entry point later.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import secrets
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from parameter_server.errors import TransportUnavailableError, WorkerError
from parameter_server.layout import Layout
from parameter_server.server import PSServer
from parameter_server.store import VersionedStore, required_bytes
from parameter_server.transport import connect
from parameter_server.transport.base import Endpoint, Transport
from parameter_server.transport.nixl import NixlRegion
from parameter_server.transport.shm import ShmSegment, new_segment_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs; plain data so it pickles under spawn."""

    layout: dict[str, Any]
    num_slots: int = 3
    address: str = ""
    nixl: bool = False
    region_name: str = ""
    base: dict[str, Any] | None = None  # the base layout of adapter versions


def default_address() -> str:
    # Unix socket paths are limited to ~107 bytes, so keep it short and in /tmp.
    name = f"staleflow-ps-{os.getpid()}-{secrets.token_hex(4)}.sock"
    return f"unix:{os.path.join(tempfile.gettempdir(), name)}"


def run_worker(config: WorkerConfig, parent: Connection) -> None:
    """Child entry point: serve until the parent says stop or goes away."""

    layout = Layout.from_dict(config.layout)
    base = None if config.base is None else Layout.from_dict(config.base)
    segment = region = server = None
    try:
        size = required_bytes(layout, config.num_slots, base)
        segment = ShmSegment.create(size, config.region_name or None)
        store = VersionedStore(layout, config.num_slots, segment.array, base)
        metadata = b""
        if config.nixl:
            try:
                region = NixlRegion(segment.array)
                metadata = region.metadata
            except TransportUnavailableError as exc:
                logger.warning("PS worker serves without NIXL: %s", exc)
        server = PSServer(
            store, config.address, segment.name, segment.address, nixl_metadata=metadata
        )
        threading.Thread(target=_watch_parent, args=(parent, server), daemon=True).start()
        parent.send(("ready", server.endpoint))
        server.serve_forever()
    except BaseException as exc:
        with contextlib.suppress(OSError, ValueError):
            parent.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if server is not None:
            server.shutdown()
        if region is not None:
            region.close()
        if segment is not None:
            segment.unlink()
            segment.close()


def _watch_parent(parent: Connection, server: Any) -> None:
    # Any message, or EOF when the parent dies, stops the worker: an orphaned
    # worker would hold gigabytes of /dev/shm forever.
    with contextlib.suppress(EOFError, OSError):
        parent.recv()
    server.shutdown()


class PSWorker:
    """Parent-side handle of one PS worker process."""

    def __init__(self, process: mp.process.BaseProcess, conn: Connection, endpoint: Endpoint):
        self._process = process
        self._conn = conn
        self.endpoint = endpoint

    @classmethod
    def start(
        cls,
        layout: Layout,
        num_slots: int = 3,
        *,
        nixl: bool = False,
        address: str | None = None,
        timeout: float = 120.0,
        base: Layout | None = None,
    ) -> PSWorker:
        """Spawn a worker for ``layout`` (with ``base``: adapter versions over that frozen
        base, held once) and wait until it serves."""

        region_name = new_segment_name()
        config = WorkerConfig(
            layout.to_dict(),
            num_slots,
            address or default_address(),
            nixl,
            region_name,
            None if base is None else base.to_dict(),
        )
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(
            target=run_worker, args=(config, child_end), name="ps-worker", daemon=True
        )
        process.start()
        child_end.close()
        try:
            if not parent_end.poll(timeout):
                raise WorkerError(f"PS worker did not come up within {timeout}s")
            try:
                status, payload = parent_end.recv()
            except EOFError:
                process.join(5)
                raise WorkerError(
                    f"PS worker died while starting (exit code {process.exitcode}); see its log"
                ) from None
            if status != "ready":
                raise WorkerError(f"PS worker failed to start: {payload}")
        except WorkerError:
            process.kill()
            process.join(5)
            parent_end.close()
            _unlink_quietly(os.path.join("/dev/shm", region_name))
            _unlink_quietly(config.address.removeprefix("unix:"))
            raise
        return cls(process, parent_end, payload)

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def connect(self, transport: str = "auto") -> Transport:
        return connect(self.endpoint, transport)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker and free its shared memory, even if it hangs."""
        with contextlib.suppress(OSError, ValueError):
            self._conn.send("stop")
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("PS worker %s ignored stop; killing it", self._process.pid)
            self._process.kill()
            self._process.join(timeout)
        self._conn.close()
        # The child unlinks on a clean exit; this covers a crash or a kill.
        if self.endpoint.region_name:
            _unlink_quietly(os.path.join("/dev/shm", self.endpoint.region_name))
        if self.endpoint.address.startswith("unix:"):
            _unlink_quietly(self.endpoint.address.removeprefix("unix:"))

    def __enter__(self) -> PSWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _unlink_quietly(path: str) -> None:
    if path.startswith("/"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
