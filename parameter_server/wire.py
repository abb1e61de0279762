"""Typed control messages between a PS worker and its clients.

Each message is a frozen dataclass packed with msgpack as ``[tag, field, ...]``
behind a 4-byte length; bulk bytes (socket transport) follow a message raw,
with their length stated in it. Receivers dispatch on the decoded type.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from parameter_server import errors

_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 64 << 20


@dataclass(frozen=True)
class Message:
    tag: ClassVar[int] = -1


@dataclass(frozen=True)
class Hello(Message):
    tag: ClassVar[int] = 1
    client: str


@dataclass(frozen=True)
class Welcome(Message):
    tag: ClassVar[int] = 2
    layout: dict[str, Any]
    fingerprint: str
    num_slots: int
    slot_stride: int
    region_name: str
    region_bytes: int
    region_addr: int
    host: str
    boot_id: str
    nixl_metadata: bytes
    # the frozen base of adapter versions, held once at base_offset ({}: no base)
    base_layout: dict[str, Any] = field(default_factory=dict)
    base_offset: int = 0


@dataclass(frozen=True)
class GetInfo(Message):
    tag: ClassVar[int] = 3


@dataclass(frozen=True)
class Info(Message):
    tag: ClassVar[int] = 4
    latest: int | None
    held: list[int]
    num_slots: int
    readers: list[int]
    pushing: bool
    version_bytes: int = 0
    base_bytes: int = 0
    base_ready: bool = False


@dataclass(frozen=True)
class AcquireRead(Message):
    """Pin a version (None: the latest); answered by Leased."""

    tag: ClassVar[int] = 5
    version: int | None


@dataclass(frozen=True)
class Leased(Message):
    tag: ClassVar[int] = 6
    lease_id: int
    version: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Release(Message):
    tag: ClassVar[int] = 7
    lease_id: int


@dataclass(frozen=True)
class Ok(Message):
    tag: ClassVar[int] = 8


@dataclass(frozen=True)
class SendVersion(Message):
    """Socket Pull: answered by Leased followed by ``nbytes`` raw bytes."""

    tag: ClassVar[int] = 9
    version: int | None


@dataclass(frozen=True)
class BeginPush(Message):
    """Reserve a slot to be written in place (shm, NIXL); answered by Leased."""

    tag: ClassVar[int] = 10
    version: int | None


@dataclass(frozen=True)
class CommitPush(Message):
    tag: ClassVar[int] = 11
    lease_id: int


@dataclass(frozen=True)
class AbortPush(Message):
    tag: ClassVar[int] = 12
    lease_id: int


@dataclass(frozen=True)
class ReceivePush(Message):
    """Socket Push: ``nbytes`` raw bytes (the packed buffer) follow; answered by Published."""

    tag: ClassVar[int] = 13
    version: int | None
    nbytes: int


@dataclass(frozen=True)
class Published(Message):
    tag: ClassVar[int] = 14
    version: int


@dataclass(frozen=True)
class Failure(Message):
    """A request failed; ``kind`` names a class in parameter_server.errors."""

    tag: ClassVar[int] = 15
    kind: str
    message: str
    version: int | None = None
    held: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shutdown(Message):
    tag: ClassVar[int] = 16


@dataclass(frozen=True)
class SendRanges(Message):
    """Socket Pull of byte ranges of a slot: Leased, then the ranges' bytes in order."""

    tag: ClassVar[int] = 17
    version: int | None
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class DeclareShards(Message):
    """A trainer's ranks will Push shards (``parameter_server.assemble.declaration``)."""

    tag: ClassVar[int] = 18
    source: dict[str, Any]


@dataclass(frozen=True)
class PushShard(Message):
    """One sender's pieces of a sharded Push: ``nbytes`` raw bytes follow, the staging
    byte ranges in order; answered by Ok, or by Published from the last sender."""

    tag: ClassVar[int] = 19
    version: int
    sender: int
    ranges: tuple[tuple[int, int], ...]
    nbytes: int


@dataclass(frozen=True)
class AcquireBase(Message):
    """Where the published base weights lie (shm, NIXL read them in place); answered by
    Leased (no lease to release: the base never changes once published)."""

    tag: ClassVar[int] = 20


@dataclass(frozen=True)
class SendBase(Message):
    """Socket Pull of the base weights: answered by Leased followed by ``nbytes`` raw bytes."""

    tag: ClassVar[int] = 21


@dataclass(frozen=True)
class BeginBase(Message):
    """Reserve the base region to be written in place (shm); answered by Leased, then
    CommitBase (or AbortPush)."""

    tag: ClassVar[int] = 22


@dataclass(frozen=True)
class CommitBase(Message):
    tag: ClassVar[int] = 23
    lease_id: int


@dataclass(frozen=True)
class ReceiveBase(Message):
    """Socket Push of the base weights: Ok, then ``nbytes`` raw bytes, then Ok."""

    tag: ClassVar[int] = 24
    nbytes: int


_TYPES: dict[int, type[Message]] = {
    cls.tag: cls
    for cls in (
        Hello,
        Welcome,
        GetInfo,
        Info,
        AcquireRead,
        Leased,
        Release,
        Ok,
        SendVersion,
        BeginPush,
        CommitPush,
        AbortPush,
        ReceivePush,
        Published,
        Failure,
        Shutdown,
        SendRanges,
        DeclareShards,
        PushShard,
        AcquireBase,
        SendBase,
        BeginBase,
        CommitBase,
        ReceiveBase,
    )
}


def encode(message: Message) -> bytes:
    body = msgpack.packb(
        [message.tag, *(getattr(message, f.name) for f in fields(message))], use_bin_type=True
    )
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    tag, *values = msgpack.unpackb(body, raw=False)
    try:
        cls = _TYPES[tag]
    except KeyError:
        raise errors.TransportError(
            f"unknown message tag {tag}; client and server differ"
        ) from None
    return cls(*values)


def send(sock: socket.socket, message: Message) -> None:
    sock.sendall(encode(message))


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket or raise TransportError on EOF."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise errors.TransportError(f"peer closed the connection after {got}/{total} bytes")
        got += n


def recv(sock: socket.socket) -> Message:
    header = bytearray(_HEADER.size)
    recv_exact(sock, memoryview(header))
    (length,) = _HEADER.unpack(header)
    if length > _MAX_MESSAGE:
        raise errors.TransportError(f"control message of {length} bytes; the stream is corrupt")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return decode(bytes(body))


def failure_from(exc: BaseException) -> Failure:
    if isinstance(exc, errors.VersionNotHeldError):
        return Failure(type(exc).__name__, str(exc), exc.version, tuple(exc.held))
    kind = type(exc).__name__
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ParameterServerError)):
        kind = "ParameterServerError"
    return Failure(kind, f"{type(exc).__name__}: {exc}" if kind != type(exc).__name__ else str(exc))


def raise_failure(failure: Failure) -> None:
    """Re-raise a server-side error as the same typed exception on the client."""
    if failure.kind == "VersionNotHeldError":
        raise errors.VersionNotHeldError(failure.version, tuple(failure.held))
    cls = getattr(errors, failure.kind, errors.ParameterServerError)
    raise cls(failure.message)
