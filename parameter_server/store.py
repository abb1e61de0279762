"""The versioned weight store of one PS worker (paper §5.1, App. A.1).

A store owns ``num_slots`` slots of one flat byte region, each big enough for
the layout. A Push writes into a slot that holds neither the latest version
nor is being read, then publishes it in one step under the metadata lock, so a
reader sees either the whole of version ``v`` or the whole of ``v + 1``, never
a mix. The latest version's slot is never a Push target, so a Pull of the
latest version never waits for a Push; a per-slot :class:`RWLock` makes a
Push that needs an older slot wait until its readers are done.

A store of LoRA versions (``base``) also holds the frozen base weights the
adapters apply to, once, after the slots: written once (:meth:`push_base`),
then read by every client that joins (:meth:`pull_base`) and never changed, so
reading it needs no lock. Every version is then the adapter alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from parameter_server.errors import (
    BaseWeightsError,
    LayoutMismatchError,
    PushInProgressError,
    PushVersionError,
    VersionNotHeldError,
)
from parameter_server.layout import Layout, Slice
from parameter_server.rwlock import RWLock

logger = logging.getLogger(__name__)

PAGE = 4096

Weights = Mapping[str, np.ndarray] | np.ndarray
"""A Push payload: name -> array matching the layout, or an already packed buffer."""


def slot_stride(layout: Layout) -> int:
    """Bytes between slot starts: page aligned so each slot can be registered on its own."""
    return max(PAGE, (layout.nbytes + PAGE - 1) // PAGE * PAGE)


def required_bytes(layout: Layout, num_slots: int, base: Layout | None = None) -> int:
    """Size of the region a store of ``num_slots`` slots (and the ``base``) needs."""
    extra = 0 if base is None else (base.nbytes + PAGE - 1) // PAGE * PAGE
    return slot_stride(layout) * num_slots + extra


@dataclass(frozen=True)
class StoreInfo:
    """What a store holds right now."""

    latest: int | None
    held: tuple[int, ...]
    num_slots: int
    readers: tuple[int, ...]
    pushing: bool
    version_bytes: int = 0  # one version of the weights: what every Push and whole Pull moves
    base_bytes: int = 0  # the frozen base of adapter versions, moved once (0: no base)
    base_ready: bool = False  # the base was pushed


class _Slot:
    __slots__ = ("index", "lock", "offset", "version", "view")

    def __init__(self, index: int, offset: int, view: np.ndarray) -> None:
        self.index = index
        self.offset = offset
        self.view = view
        self.version: int | None = None
        self.lock = RWLock()


class ReadLease:
    """Shared hold on one slot's version; the slot is not overwritten until released."""

    def __init__(self, slot: _Slot, version: int) -> None:
        self._slot = slot
        self.version = version
        self._released = False

    @property
    def offset(self) -> int:
        """Byte offset of the slot in the store's region (for zero-copy transports)."""
        return self._slot.offset

    @property
    def view(self) -> np.ndarray:
        """The slot's bytes (read-only by contract)."""
        return self._slot.view

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._slot.lock.release_read()

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class WriteLease:
    """Exclusive hold on a retired slot while version ``version`` is written into it."""

    def __init__(self, store: VersionedStore, slot: _Slot, version: int) -> None:
        self._store = store
        self._slot = slot
        self.version = version
        self._done = False

    @property
    def offset(self) -> int:
        return self._slot.offset

    @property
    def view(self) -> np.ndarray:
        return self._slot.view

    def commit(self) -> int:
        """Publish the written slot as the latest version."""
        if self._done:
            raise RuntimeError("this push was already committed or aborted")
        self._done = True
        self._store._finish_push(self._slot, self.version, publish=True)
        return self.version

    def abort(self) -> None:
        """Give the slot back empty; the latest version is untouched."""
        if not self._done:
            self._done = True
            self._store._finish_push(self._slot, self.version, publish=False)

    def __enter__(self) -> WriteLease:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


class BaseLease:
    """Exclusive hold on the base region while the base weights are written into it."""

    def __init__(self, store: VersionedStore) -> None:
        self._store = store
        self._done = False

    @property
    def offset(self) -> int:
        return self._store.base_offset

    @property
    def view(self) -> np.ndarray:
        return self._store.base_view

    def commit(self) -> int:
        """Publish the base (returns -1: the base is no version)."""
        if self._done:
            raise RuntimeError("this base push was already committed or aborted")
        self._done = True
        self._store._finish_base(publish=True)
        return -1

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._store._finish_base(publish=False)

    def __enter__(self) -> BaseLease:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


class VersionedStore:
    """Holds the last few published versions of one layout.

    ``memory`` is the flat uint8 region the slots live in (shared memory for a
    PS worker, so transports can read slots without a copy through Python); by
    default the store allocates its own. ``base``: the layout of the frozen base
    weights of adapter versions, held once after the slots. Thread safe.
    """

    def __init__(
        self,
        layout: Layout,
        num_slots: int = 3,
        memory: np.ndarray | None = None,
        base: Layout | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_slots must be at least 2 (one readable while one is written), got {num_slots}"
            )
        stride = slot_stride(layout)
        need = required_bytes(layout, num_slots, base)
        if memory is None:
            memory = np.zeros(need, dtype=np.uint8)
        if memory.dtype != np.uint8 or memory.ndim != 1 or memory.nbytes < need:
            raise ValueError(
                f"memory must be a 1-D uint8 array of at least {need} bytes "
                f"(required_bytes(layout, {num_slots}, base)), got {memory.dtype} {memory.shape}"
            )
        self.layout = layout
        self.base_layout = base
        self.memory = memory
        self.base_offset = stride * num_slots
        self.base_view = memory[self.base_offset : self.base_offset + (base.nbytes if base else 0)]
        self._base_state = "empty"  # -> "writing" -> "ready" (once), back to empty on abort
        self._slots = [
            _Slot(i, i * stride, memory[i * stride : i * stride + layout.nbytes])
            for i in range(num_slots)
        ]
        self._meta = threading.Lock()
        self._latest: _Slot | None = None
        self._pushing = False

    # -- state --------------------------------------------------------------------

    @property
    def latest(self) -> int | None:
        slot = self._latest
        return None if slot is None else slot.version

    def versions(self) -> tuple[int, ...]:
        """Versions a Pull can get right now, oldest first."""
        with self._meta:
            return self._held()

    def info(self) -> StoreInfo:
        with self._meta:
            return StoreInfo(
                latest=None if self._latest is None else self._latest.version,
                held=self._held(),
                num_slots=len(self._slots),
                readers=tuple(s.lock.readers for s in self._slots),
                pushing=self._pushing,
                version_bytes=self.layout.nbytes,
                base_bytes=self.base_view.nbytes,
                base_ready=self._base_state == "ready",
            )

    def _held(self) -> tuple[int, ...]:
        return tuple(sorted(s.version for s in self._slots if s.version is not None))

    # -- Pull -----------------------------------------------------------------------

    def acquire_read(self, version: int | None = None) -> ReadLease:
        """Pin ``version`` (default: the latest) until the lease is released. Never blocks."""
        with self._meta:
            if version is None:
                slot = self._latest
            else:
                slot = next((s for s in self._slots if s.version == version), None)
            if slot is None or slot.version is None:
                raise VersionNotHeldError(version, self._held())
            # Writers only ever hold retired slots, so this cannot fail.
            if not slot.lock.try_acquire_read():
                raise AssertionError("a published slot was write-locked")
            return ReadLease(slot, slot.version)

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        """Copy ``version`` (default: the latest) into ``dest``; return the version copied."""
        flat = self.layout.check_buffer(dest, "Pull destination")
        with self.acquire_read(version) as lease:
            np.copyto(flat, lease.view)
            return lease.version

    def pull_slices(
        self, dest: np.ndarray, slices: Sequence[Slice], version: int | None = None
    ) -> int:
        """Copy only ``slices`` of ``version`` into the same byte ranges of ``dest``."""
        flat = self.layout.check_buffer(dest, "Pull destination")
        ranges = self.layout.byte_ranges(slices)
        with self.acquire_read(version) as lease:
            for start, stop in ranges:
                np.copyto(flat[start:stop], lease.view[start:stop])
            return lease.version

    # -- Push -----------------------------------------------------------------------

    def next_version(self) -> int:
        latest = self.latest
        return 0 if latest is None else latest + 1

    def begin_push(self, version: int | None = None, timeout: float | None = None) -> WriteLease:
        """Reserve a slot for ``version`` and return a lease to write it through.

        ``version`` must be ``latest + 1`` (any non-negative number for the first
        Push). The slot chosen is the oldest one nobody reads; if every older
        slot is being read, this waits for the oldest one's readers.
        """
        with self._meta:
            if self._pushing:
                raise PushInProgressError(
                    "another Push is still in flight; wait for its handle before pushing again"
                )
            expected = self.next_version()
            if version is None:
                version = expected
            elif self._latest is None and (not isinstance(version, int) or version < 0):
                raise PushVersionError(f"the first version must be an int >= 0, got {version!r}")
            elif self._latest is not None and version != expected:
                raise PushVersionError(
                    f"Push of version {version} but the latest is {self.latest}; push version "
                    f"{expected} next (versions advance by one)"
                )
            candidates = [s for s in self._slots if s is not self._latest]
            slot = min(
                candidates,
                key=lambda s: (s.lock.readers > 0, -1 if s.version is None else s.version),
            )
            retired = slot.version
            slot.version = None  # no new reader can find it from here on
            self._pushing = True
        if retired is not None:
            logger.debug("push of v%d retires v%d from slot %d", version, retired, slot.index)
        if not slot.lock.acquire_write(timeout):
            with self._meta:
                # Nothing was written: the retired version is intact, so it comes back.
                slot.version = retired
                self._pushing = False
            raise TimeoutError(
                f"slot {slot.index} is still being read after {timeout}s; a Pull of an old "
                "version is stuck, or raise num_slots"
            )
        return WriteLease(self, slot, version)

    def push(self, weights: Weights, version: int | None = None) -> int:
        """Copy ``weights`` in and publish them as ``version`` (default: latest + 1)."""
        if isinstance(weights, np.ndarray):
            packed = self.layout.check_buffer(weights, "packed Push buffer", LayoutMismatchError)
            self._check_version(version)
            with self.begin_push(version) as lease:
                np.copyto(lease.view, packed)
        else:
            self.layout.validate(weights)  # before any state changes
            self._check_version(version)
            with self.begin_push(version) as lease:
                views = self.layout.views(lease.view)
                for name, view in views.items():
                    np.copyto(view, weights[name].view(view.dtype), casting="no")
        return lease.version

    def _check_version(self, version: int | None) -> None:
        # Checked again under the lock by begin_push; this early check only keeps a
        # bad call from validating gigabytes first.
        latest = self.latest
        if version is not None and latest is not None and version != latest + 1:
            raise PushVersionError(
                f"Push of version {version} but the latest is {latest}; push version "
                f"{latest + 1} next (versions advance by one)"
            )

    # -- the base of adapter versions --------------------------------------------------

    def _need_base(self) -> Layout:
        if self.base_layout is None:
            raise BaseWeightsError(
                "this store holds full-weight versions, no base: start it with base=<the "
                "base layout> to hold adapter versions"
            )
        return self.base_layout

    def begin_base(self) -> BaseLease:
        """Reserve the base region to write the base weights into, once."""
        self._need_base()
        with self._meta:
            if self._base_state != "empty":
                raise BaseWeightsError(
                    f"the base weights are {'published' if self._base_state == 'ready' else 'being written'}"
                    " already: they are written once per store (a restarted replica starts empty)"
                )
            self._base_state = "writing"
        return BaseLease(self)

    def push_base(self, weights: Weights) -> None:
        """Copy the base weights in and publish them (once)."""
        base = self._need_base()
        if isinstance(weights, np.ndarray):
            packed = base.check_buffer(weights, "packed base buffer", LayoutMismatchError)
            with self.begin_base() as lease:
                np.copyto(lease.view, packed)
        else:
            base.validate(weights)
            with self.begin_base() as lease:
                base.pack(weights, lease.view)

    def pull_base(self, dest: np.ndarray) -> None:
        """Copy the base weights into ``dest`` (``base_layout.nbytes`` bytes)."""
        flat = self._need_base().check_buffer(dest, "base Pull destination")
        self.check_base_ready()
        np.copyto(flat, self.base_view)  # published once and never written again: no lock

    def check_base_ready(self) -> None:
        self._need_base()
        if self._base_state != "ready":
            raise BaseWeightsError(
                "the base weights were not pushed to this PS yet: push_base them before "
                "the first Pull (the driver does, with version 0)"
            )

    def _finish_base(self, publish: bool) -> None:
        with self._meta:
            self._base_state = "ready" if publish else "empty"

    def _finish_push(self, slot: _Slot, version: int, publish: bool) -> None:
        slot.lock.release_write()
        with self._meta:
            if publish:
                slot.version = version
                self._latest = slot
            self._pushing = False
        if not publish:
            logger.warning("push of version %d aborted; latest stays %s", version, self.latest)
