"""Same-host fast path: the worker's slots live in a POSIX shared-memory segment.

A Pull maps the worker's segment once (at connect) and is then a single
``np.copyto`` from the pinned slot into the reader's buffer: one memory copy,
as fast as an in-process ``memcpy``. The segment is pre-faulted when created
and when attached, so no Pull pays for page faults.

We map ``/dev/shm`` files directly instead of using
``multiprocessing.shared_memory``: on Python 3.11 merely attaching to a segment
registers it with the attaching process's resource tracker, which then unlinks
it (and warns) when that process exits, pulling it from under the worker.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Sequence

import numpy as np

from parameter_server import wire
from parameter_server.errors import TransportError, TransportUnavailableError
from parameter_server.layout import Layout, Slice
from parameter_server.store import StoreInfo, Weights
from parameter_server.transport.base import (
    ControlClient,
    Endpoint,
    pack_for_push,
    validate_push,
)

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "staleflow-ps-"
_PAGE = mmap.PAGESIZE
# Linux >= 5.14: fault every page in writable without changing its contents.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def new_segment_name() -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


class ShmSegment:
    """A named, pre-faulted shared-memory region exposed as a flat uint8 array."""

    def __init__(self, name: str, size: int, fd: int, created: bool) -> None:
        self.name = name
        self.size = size
        self.created = created
        self._fd = fd
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self._prefault(fresh=created)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @property
    def address(self) -> int:
        """Virtual address of the mapping in this process (for NIXL registration)."""
        return int(self.array.ctypes.data)

    @classmethod
    def create(cls, size: int, name: str | None = None) -> ShmSegment:
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        name = name or new_segment_name()
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise TransportUnavailableError(
                f"cannot create shared memory {path}: {exc}; check that {SHM_DIR} is mounted "
                "and has room (df -h /dev/shm)"
            ) from exc
        try:
            os.ftruncate(fd, size)
            return cls(name, size, fd, created=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TransportUnavailableError(
                f"cannot open shared memory {path}: {exc}; the worker is on another host or "
                "has stopped; use transport='nixl' or 'socket'"
            ) from exc
        try:
            return cls(name, os.fstat(fd).st_size, fd, created=False)
        except BaseException:
            os.close(fd)
            raise

    def _prefault(self, fresh: bool) -> None:
        assert self._mmap is not None
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
            return
        except (OSError, ValueError):
            pass
        if fresh:
            self.array[::_PAGE] = 0  # nobody else sees the segment yet, so writing is safe
        else:
            # Reading maps every page; a write to live data could race with a Push.
            int(self.array[::_PAGE].sum())

    def close(self) -> None:
        """Unmap (once no numpy view is alive) and close the descriptor."""
        if self._mmap is None:
            return
        self.array = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            # A view still held elsewhere keeps the mapping; the GC unmaps it later.
            self._mmap.close()
        self._mmap = None
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ShmTransport:
    """Pull/Push by copying straight out of / into the worker's shared segment."""

    name = "shm"

    def __init__(self, endpoint: Endpoint) -> None:
        if not endpoint.same_host():
            raise TransportUnavailableError(
                f"worker at {endpoint.address} runs on host {endpoint.host}, not here; "
                "use transport='nixl' or 'socket'"
            )
        self._segment = ShmSegment.attach(endpoint.region_name)
        try:
            self._control = ControlClient(endpoint, f"shm-{os.getpid()}")
        except BaseException:
            self._segment.close()
            raise
        self.layout: Layout = self._control.layout
        self.base_layout: Layout | None = self._control.base_layout
        if self._segment.size < self._control.welcome.region_bytes:
            self.close()
            raise TransportError("shared segment is smaller than the worker says")

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        flat = self.layout.check_buffer(dest, "Pull destination")
        lease = self._control.acquire_read(version)
        try:
            np.copyto(flat, self._segment.array[lease.offset : lease.offset + lease.nbytes])
        finally:
            self._control.release(lease.lease_id)
        return lease.version

    def pull_slices(
        self, dest: np.ndarray, slices: Sequence[Slice], version: int | None = None
    ) -> int:
        flat = self.layout.check_buffer(dest, "Pull destination")
        ranges = self.layout.byte_ranges(slices)
        lease = self._control.acquire_read(version)
        try:
            base = lease.offset
            for start, stop in ranges:
                np.copyto(flat[start:stop], self._segment.array[base + start : base + stop])
        finally:
            self._control.release(lease.lease_id)
        return lease.version

    def push(self, weights: Weights, version: int | None = None) -> int:
        validate_push(self.layout, weights)
        lease = self._control.begin_push(version)
        try:
            slot = self._segment.array[lease.offset : lease.offset + lease.nbytes]
            pack_for_push(self.layout, weights, slot)
        except BaseException:
            self._control.abort_push(lease.lease_id)
            raise
        return self._control.commit_push(lease.lease_id)

    def pull_base(self, dest: np.ndarray) -> None:
        flat = self._control.need_base().check_buffer(dest, "base Pull destination")
        where = self._control.expect(self._control.request(wire.AcquireBase()), wire.Leased)
        # published once and never written again: no lease to hold while copying
        np.copyto(flat, self._segment.array[where.offset : where.offset + where.nbytes])

    def push_base(self, weights: Weights) -> None:
        base = self._control.need_base()
        validate_push(base, weights)
        lease = self._control.expect(self._control.request(wire.BeginBase()), wire.Leased)
        try:
            region = self._segment.array[lease.offset : lease.offset + lease.nbytes]
            pack_for_push(base, weights, region)
        except BaseException:
            self._control.abort_push(lease.lease_id)
            raise
        self._control.expect(self._control.request(wire.CommitBase(lease.lease_id)), wire.Ok)

    def info(self) -> StoreInfo:
        return self._control.info()

    def close(self) -> None:
        self._control.close()
        self._segment.close()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
