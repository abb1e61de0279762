"""The Transport contract and the control connection every remote transport shares.

A transport is a client of one PS worker. Whatever moves the bytes (a shared
mapping, NIXL/UCX, a socket), the protocol is the same: pin a version on the
worker (a read lease, so the slot cannot be overwritten), move the slot's
bytes, release the lease. Pushes reserve a slot, fill it and commit it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

from parameter_server import wire
from parameter_server.errors import BaseWeightsError, LayoutMismatchError, TransportError
from parameter_server.layout import Layout, Slice
from parameter_server.store import StoreInfo, Weights

# Control replies are small; bulk transfers on the socket transport may take a while.
DEFAULT_TIMEOUT_S = 300.0

M = TypeVar("M", bound=wire.Message)


@runtime_checkable
class Transport(Protocol):
    """A client-side handle that moves whole versions to and from one PS worker.

    Invariants: ``pull`` returns the version it copied, and ``dest`` then holds
    exactly that version's bytes (never a mix); a failed call leaves the
    worker's stored versions as they were.
    """

    name: str
    layout: Layout

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        """Copy ``version`` (default: the latest) into ``dest`` (``layout.nbytes`` bytes)."""
        ...

    def pull_slices(
        self, dest: np.ndarray, slices: Sequence[Slice], version: int | None = None
    ) -> int:
        """Copy only ``slices`` of ``version`` into the same byte ranges of ``dest``.

        Lets a receiver gather one version from several replicas (App. A.2).
        """
        ...

    def push(self, weights: Weights, version: int | None = None) -> int:
        """Publish ``weights`` as ``version`` (default: latest + 1); return the version."""
        ...

    def pull_base(self, dest: np.ndarray) -> None:
        """Copy the frozen base of adapter versions into ``dest`` (``base_layout.nbytes``
        bytes); ``BaseWeightsError`` if the worker has none or it was not pushed yet."""
        ...

    def push_base(self, weights: Weights) -> None:
        """Publish the base of adapter versions, once per worker."""
        ...

    def info(self) -> StoreInfo:
        """Versions held by the worker right now."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Transport: ...

    def __exit__(self, *exc: object) -> None: ...


@cache
def boot_id() -> str:
    """Identifies this kernel instance: equal boot ids mean one shared /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Endpoint:
    """How to reach a PS worker: picklable, handed to other processes.

    ``address`` is ``unix:/path/to/socket`` or ``tcp:host:port``.
    """

    address: str
    host: str
    boot_id: str
    region_name: str

    def same_host(self) -> bool:
        return self.boot_id == boot_id() and self.host == socket.gethostname()

    def open_socket(self, timeout: float = DEFAULT_TIMEOUT_S) -> socket.socket:
        kind, _, rest = self.address.partition(":")
        try:
            if kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(rest)
            elif kind == "tcp":
                host, _, port = rest.rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                raise TransportError(
                    f"bad PS address {self.address!r}; use unix:/path or tcp:host:port"
                )
        except OSError as exc:
            raise TransportError(
                f"cannot reach the PS worker at {self.address}: {exc}; is it running?"
            ) from exc
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        return sock


class ControlClient:
    """One request/reply control connection to a PS worker (thread safe)."""

    def __init__(self, endpoint: Endpoint, client_name: str = "") -> None:
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self.sock = endpoint.open_socket()
        self.welcome = self._expect(
            self.request(wire.Hello(client_name or f"pid{os.getpid()}")), wire.Welcome
        )
        self.layout = Layout.from_dict(self.welcome.layout)
        if self.layout.fingerprint != self.welcome.fingerprint:
            raise TransportError("layout fingerprint mismatch; client and worker code differ")
        base = self.welcome.base_layout
        self.base_layout: Layout | None = Layout.from_dict(base) if base else None

    @property
    def lock(self) -> threading.Lock:
        """Held across a request and any raw bytes that follow it."""
        return self._lock

    def request(self, message: wire.Message) -> wire.Message:
        with self._lock:
            return self.request_locked(message)

    def request_locked(self, message: wire.Message) -> wire.Message:
        try:
            wire.send(self.sock, message)
            reply = wire.recv(self.sock)
        except OSError as exc:
            raise TransportError(f"PS worker at {self.endpoint.address} went away: {exc}") from exc
        if isinstance(reply, wire.Failure):
            wire.raise_failure(reply)
        return reply

    @staticmethod
    def _expect(reply: wire.Message, kind: type[M]) -> M:
        if not isinstance(reply, kind):
            raise TransportError(f"expected {kind.__name__}, got {type(reply).__name__}")
        return reply

    def expect(self, reply: wire.Message, kind: type[M]) -> M:
        return self._expect(reply, kind)

    def info(self) -> StoreInfo:
        reply = self._expect(self.request(wire.GetInfo()), wire.Info)
        return StoreInfo(
            latest=reply.latest,
            held=tuple(reply.held),
            num_slots=reply.num_slots,
            readers=tuple(reply.readers),
            pushing=reply.pushing,
            version_bytes=reply.version_bytes,
            base_bytes=reply.base_bytes,
            base_ready=reply.base_ready,
        )

    def need_base(self) -> Layout:
        """The base layout; ``BaseWeightsError`` before a request when the worker has none."""
        if self.base_layout is None:
            raise BaseWeightsError(
                f"the PS worker at {self.endpoint.address} holds full-weight versions, no "
                "base: start it with the base layout to hold adapter versions"
            )
        return self.base_layout

    def stream_base_in(self, dest: np.ndarray) -> None:
        """Pull the base over this socket (each transport's way once, except shm's)."""
        flat = self.need_base().check_buffer(dest, "base Pull destination")
        with self._lock:
            lease = self._expect(self.request_locked(wire.SendBase()), wire.Leased)
            if lease.nbytes != flat.nbytes:
                raise TransportError(f"worker sent {lease.nbytes} bytes, expected {flat.nbytes}")
            try:
                wire.recv_exact(self.sock, flat.data)
            except OSError as exc:
                raise TransportError(f"Pull of the base weights broke: {exc}") from exc

    def stream_base_out(self, weights: Weights) -> None:
        """Push the base over this socket."""
        base = self.need_base()
        validate_push(base, weights)
        with self._lock:
            try:
                wire.send(self.sock, wire.ReceiveBase(base.nbytes))
                reply = wire.recv(self.sock)  # Ok once the region is reserved, or Failure
                if isinstance(reply, wire.Failure):
                    wire.raise_failure(reply)
                self._expect(reply, wire.Ok)
                send_packed(self.sock, base, weights)
                reply = wire.recv(self.sock)
            except OSError as exc:
                raise TransportError(f"Push of the base weights broke: {exc}") from exc
            if isinstance(reply, wire.Failure):
                wire.raise_failure(reply)
            self._expect(reply, wire.Ok)

    def acquire_read(self, version: int | None) -> wire.Leased:
        return self._expect(self.request(wire.AcquireRead(version)), wire.Leased)

    def release(self, lease_id: int) -> None:
        self._expect(self.request(wire.Release(lease_id)), wire.Ok)

    def begin_push(self, version: int | None) -> wire.Leased:
        return self._expect(self.request(wire.BeginPush(version)), wire.Leased)

    def commit_push(self, lease_id: int) -> int:
        return self._expect(self.request(wire.CommitPush(lease_id)), wire.Published).version

    def abort_push(self, lease_id: int) -> None:
        self._expect(self.request(wire.AbortPush(lease_id)), wire.Ok)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def pack_for_push(layout: Layout, weights: Weights, out: np.ndarray) -> None:
    """Validate and pack ``weights`` into ``out`` (a slot or staging buffer)."""
    if isinstance(weights, np.ndarray):
        np.copyto(out, layout.check_buffer(weights, "packed Push buffer", LayoutMismatchError))
    else:
        layout.pack(weights, out)


def send_packed(sock: socket.socket, layout: Layout, weights: Weights) -> None:
    """Stream the packed image of ``weights`` without building it: padding, then each
    parameter in layout order."""
    if isinstance(weights, np.ndarray):
        sock.sendall(weights.reshape(-1).view(np.uint8).data)
        return
    position = 0
    for spec in layout:
        offset = layout.offset(spec.name)
        if offset > position:
            sock.sendall(bytes(offset - position))
        arr = np.ascontiguousarray(weights[spec.name])
        sock.sendall(arr.reshape(-1).view(np.uint8).data)
        position = offset + spec.nbytes
    if layout.nbytes > position:
        sock.sendall(bytes(layout.nbytes - position))


def validate_push(layout: Layout, weights: Weights) -> None:
    """All client-side checks of a Push, done before the worker is asked for a slot."""
    if isinstance(weights, np.ndarray):
        layout.check_buffer(weights, "packed Push buffer", LayoutMismatchError)
    else:
        layout.validate(weights)
