"""Serves one VersionedStore to clients in other processes over a control socket.

Each connection gets its own thread. Leases are tracked per connection and
released when it closes, so a reader that dies mid-Pull cannot block Pushes
forever, and a writer that dies mid-Push leaves the latest version intact.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from parameter_server import wire
from parameter_server.assemble import ShardAssembler
from parameter_server.errors import (
    LayoutMismatchError,
    ParameterServerError,
    PushInProgressError,
    TransportError,
)
from parameter_server.store import (
    BaseLease,
    ReadLease,
    VersionedStore,
    WriteLease,
    slot_stride,
)
from parameter_server.transport.base import Endpoint, boot_id

logger = logging.getLogger(__name__)

L = TypeVar("L")


def _listen(address: str) -> socket.socket:
    kind, _, rest = address.partition(":")
    if kind == "unix":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rest)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(rest)
    elif kind == "tcp":
        host, _, port = rest.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
    else:
        raise ValueError(f"bad listen address {address!r}; use unix:/path or tcp:host:port")
    sock.listen(64)
    return sock


class PSServer:
    """Control-socket front end of a store whose slots live in ``region``."""

    def __init__(
        self,
        store: VersionedStore,
        address: str,
        region_name: str = "",
        region_addr: int = 0,
        nixl_metadata: bytes = b"",
    ) -> None:
        self.store = store
        self._listener = _listen(address)
        if address.startswith("tcp:"):
            # Advertise what a client can dial: the real port, and a name, not 0.0.0.0.
            host, port = self._listener.getsockname()[:2]
            if host in ("0.0.0.0", ""):
                host = socket.gethostname()
            address = f"tcp:{host}:{port}"
        self.address = address
        self._welcome = wire.Welcome(
            layout=store.layout.to_dict(),
            fingerprint=store.layout.fingerprint,
            num_slots=store.info().num_slots,
            slot_stride=slot_stride(store.layout),
            region_name=region_name,
            region_bytes=int(store.memory.nbytes),
            region_addr=region_addr,
            host=socket.gethostname(),
            boot_id=boot_id(),
            nixl_metadata=nixl_metadata,
            base_layout={} if store.base_layout is None else store.base_layout.to_dict(),
            base_offset=store.base_offset,
        )
        self.endpoint = Endpoint(address, socket.gethostname(), boot_id(), region_name)
        self._assembler: ShardAssembler | None = None  # set by the first DeclareShards
        self._declare_lock = threading.Lock()
        self._lease_ids = itertools.count(1)
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.on_shutdown_request: Callable[[], None] = self.shutdown

    def serve_forever(self) -> None:
        """Accept connections until :meth:`shutdown`."""
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                break
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                conn.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="ps-server", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        if self.address.startswith("unix:"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[5:])

    # -- one connection -----------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        reads: dict[int, ReadLease] = {}
        writes: dict[int, WriteLease | BaseLease] = {}
        try:
            while True:
                message = wire.recv(conn)
                try:
                    reply = self._dispatch(conn, message, reads, writes)
                except (ParameterServerError, ValueError, TimeoutError) as exc:
                    if isinstance(exc, TransportError):
                        raise
                    reply = wire.failure_from(exc)
                if reply is not None:
                    wire.send(conn, reply)
        except (TransportError, OSError) as exc:
            if not self._stopping.is_set():
                logger.debug("PS client connection closed: %s", exc)
        finally:
            for lease in reads.values():
                lease.release()
            for write in writes.values():
                write.abort()
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _dispatch(
        self,
        conn: socket.socket,
        msg: wire.Message,
        reads: dict[int, ReadLease],
        writes: dict[int, WriteLease | BaseLease],
    ) -> wire.Message | None:
        store = self.store
        match msg:
            case wire.Hello():
                return self._welcome
            case wire.GetInfo():
                info = store.info()
                return wire.Info(
                    info.latest,
                    list(info.held),
                    info.num_slots,
                    list(info.readers),
                    info.pushing,
                    info.version_bytes,
                    info.base_bytes,
                    info.base_ready,
                )
            case wire.AcquireRead(version=version):
                lease = store.acquire_read(version)
                lease_id = next(self._lease_ids)
                reads[lease_id] = lease
                return wire.Leased(lease_id, lease.version, lease.offset, store.layout.nbytes)
            case wire.Release(lease_id=lease_id):
                self._pop(reads, lease_id).release()
                return wire.Ok()
            case wire.SendVersion(version=version):
                with store.acquire_read(version) as lease:
                    wire.send(conn, wire.Leased(0, lease.version, lease.offset, lease.view.nbytes))
                    conn.sendall(lease.view.data)
                return None
            case wire.SendRanges(version=version, ranges=ranges):
                spans = [(int(a), int(b)) for a, b in ranges]
                if any(not 0 <= a <= b <= store.layout.nbytes for a, b in spans):
                    raise LayoutMismatchError(f"byte ranges {spans[:3]} fall outside the layout")
                with store.acquire_read(version) as lease:
                    total = sum(b - a for a, b in spans)
                    wire.send(conn, wire.Leased(0, lease.version, lease.offset, total))
                    for a, b in spans:
                        conn.sendall(lease.view[a:b].data)
                return None
            case wire.BeginPush(version=version):
                write = store.begin_push(version)
                lease_id = next(self._lease_ids)
                writes[lease_id] = write
                return wire.Leased(lease_id, write.version, write.offset, store.layout.nbytes)
            case wire.CommitPush(lease_id=lease_id):
                return wire.Published(self._pop(writes, lease_id).commit())
            case wire.AbortPush(lease_id=lease_id):
                self._pop(writes, lease_id).abort()
                return wire.Ok()
            case wire.ReceivePush(version=version, nbytes=nbytes):
                return self._receive_push(conn, version, nbytes)
            case wire.DeclareShards(source=source):
                self._declare(source)
                return wire.Ok()
            case wire.PushShard(version=version, sender=sender, ranges=ranges, nbytes=nbytes):
                return self._push_shard(conn, version, sender, ranges, nbytes)
            case wire.AcquireBase():
                store.check_base_ready()
                return wire.Leased(0, -1, store.base_offset, store.base_view.nbytes)
            case wire.SendBase():
                store.check_base_ready()
                wire.send(conn, wire.Leased(0, -1, store.base_offset, store.base_view.nbytes))
                conn.sendall(store.base_view.data)
                return None
            case wire.BeginBase():
                base = store.begin_base()
                lease_id = next(self._lease_ids)
                writes[lease_id] = base
                return wire.Leased(lease_id, -1, base.offset, base.view.nbytes)
            case wire.CommitBase(lease_id=lease_id):
                self._pop(writes, lease_id).commit()
                return wire.Ok()
            case wire.ReceiveBase(nbytes=nbytes):
                return self._receive_base(conn, nbytes)
            case wire.Shutdown():
                wire.send(conn, wire.Ok())
                self.on_shutdown_request()
                return None
        raise TransportError(f"unexpected {type(msg).__name__} from a client")

    def _receive_push(self, conn: socket.socket, version: int | None, nbytes: int) -> wire.Message:
        if nbytes != self.store.layout.nbytes:
            raise LayoutMismatchError(
                f"Push of {nbytes} bytes but the layout is {self.store.layout.nbytes}; "
                "client and worker disagree on the layout"
            )
        write = self.store.begin_push(version)
        try:
            wire.send(conn, wire.Ok())
            wire.recv_exact(conn, write.view.data)
        except BaseException:
            write.abort()
            raise
        return wire.Published(write.commit())

    def _receive_base(self, conn: socket.socket, nbytes: int) -> wire.Message:
        if nbytes != self.store.base_view.nbytes:
            raise LayoutMismatchError(
                f"base Push of {nbytes} bytes but the base layout is "
                f"{self.store.base_view.nbytes}; client and worker disagree on the layout"
            )
        base = self.store.begin_base()
        try:
            wire.send(conn, wire.Ok())
            wire.recv_exact(conn, base.view.data)
        except BaseException:
            base.abort()
            raise
        base.commit()
        return wire.Ok()

    def _declare(self, source: dict[str, Any]) -> None:
        with self._declare_lock:
            current = self._assembler
            if current is not None and current.matches(source):
                return
            if current is not None and current.busy:
                raise PushInProgressError(
                    "a sharded Push of another trainer layout is still being gathered"
                )
            self._assembler = ShardAssembler.from_declaration(self.store, source)

    def _push_shard(
        self,
        conn: socket.socket,
        version: int,
        sender: int,
        ranges: list[list[int]],
        nbytes: int,
    ) -> wire.Message:
        spans = [(int(a), int(b)) for a, b in ranges]
        assembler = self._assembler
        consumed = 0

        def fill(view: Any) -> None:
            nonlocal consumed
            wire.recv_exact(conn, view.data)
            consumed += view.nbytes

        try:
            if assembler is None:
                raise ParameterServerError(
                    "PushShard before DeclareShards; declare the trainer's shards first"
                )
            if nbytes != sum(b - a for a, b in spans):
                raise LayoutMismatchError(f"PushShard says {nbytes} bytes; its ranges hold others")
            published = assembler.receive(version, sender, spans, fill)
        except TransportError:
            raise
        except (ParameterServerError, ValueError):
            _drain(conn, nbytes - consumed)  # keep the stream in step, then answer
            raise
        return wire.Ok() if published is None else wire.Published(published)

    @staticmethod
    def _pop(table: dict[int, L], lease_id: int) -> L:
        try:
            return table.pop(lease_id)
        except KeyError:
            raise ParameterServerError(
                f"lease {lease_id} is not held by this connection; release each lease once"
            ) from None


def _drain(conn: socket.socket, nbytes: int) -> None:
    """Read and drop the ``nbytes`` of payload a refused request still has in flight."""
    scratch = bytearray(min(nbytes, 1 << 20))
    while nbytes > 0:
        n = conn.recv_into(scratch, min(nbytes, len(scratch)))
        if n == 0:
            raise TransportError("peer closed the connection inside a refused PushShard")
        nbytes -= n
