"""Last-resort transport: the bytes travel on the control socket itself.

Works wherever the worker's address is reachable (a Unix socket on one host,
TCP across hosts) and needs nothing but the standard library. The worker pins
the version for the duration of the send, so the stream is one whole version.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from parameter_server import wire
from parameter_server.errors import TransportError
from parameter_server.layout import Layout, Slice
from parameter_server.store import StoreInfo, Weights
from parameter_server.transport.base import ControlClient, Endpoint, send_packed, validate_push


class SocketTransport:
    """Pull/Push streamed over the worker's control connection."""

    name = "socket"

    def __init__(self, endpoint: Endpoint) -> None:
        self._control = ControlClient(endpoint, f"socket-{os.getpid()}")
        self.layout: Layout = self._control.layout
        self.base_layout: Layout | None = self._control.base_layout

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        flat = self.layout.check_buffer(dest, "Pull destination")
        control = self._control
        with control.lock:
            lease = control.expect(control.request_locked(wire.SendVersion(version)), wire.Leased)
            if lease.nbytes != flat.nbytes:
                raise TransportError(f"worker sent {lease.nbytes} bytes, expected {flat.nbytes}")
            try:
                wire.recv_exact(control.sock, flat.data)
            except OSError as exc:
                raise TransportError(f"Pull of version {lease.version} broke: {exc}") from exc
        return lease.version

    def pull_slices(
        self, dest: np.ndarray, slices: Sequence[Slice], version: int | None = None
    ) -> int:
        flat = self.layout.check_buffer(dest, "Pull destination")
        ranges = self.layout.byte_ranges(slices)
        control = self._control
        with control.lock:
            request = wire.SendRanges(version, tuple(ranges))
            lease = control.expect(control.request_locked(request), wire.Leased)
            try:
                for start, stop in ranges:
                    wire.recv_exact(control.sock, flat[start:stop].data)
            except OSError as exc:
                raise TransportError(f"Pull of version {lease.version} broke: {exc}") from exc
        return lease.version

    def push(self, weights: Weights, version: int | None = None) -> int:
        validate_push(self.layout, weights)
        control = self._control
        with control.lock:
            try:
                wire.send(control.sock, wire.ReceivePush(version, self.layout.nbytes))
                reply = wire.recv(control.sock)  # Ok once a slot is reserved, or Failure
                if isinstance(reply, wire.Failure):
                    wire.raise_failure(reply)
                control.expect(reply, wire.Ok)
                send_packed(control.sock, self.layout, weights)
                reply = wire.recv(control.sock)
            except OSError as exc:
                raise TransportError(f"Push broke: {exc}") from exc
            if isinstance(reply, wire.Failure):
                wire.raise_failure(reply)
            return control.expect(reply, wire.Published).version

    def pull_base(self, dest: np.ndarray) -> None:
        self._control.stream_base_in(dest)

    def push_base(self, weights: Weights) -> None:
        self._control.stream_base_out(weights)

    def info(self) -> StoreInfo:
        return self._control.info()

    def close(self) -> None:
        self._control.close()

    def __enter__(self) -> SocketTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
