"""A Push made by many senders: every trainer rank sends its own shards (paper §5.1, App. A).

The trainer's ranks each hold a tensor-parallel shard of the model (and data-parallel
ranks hold copies). Instead of gathering the whole model on one rank, each rank sends the
pieces the communication plan (:mod:`parameter_server.plan`) gives it, straight into a
staging buffer here; the last sender's arrival converts the staged Megatron shards into
the store's Hugging Face layout (:class:`~parameter_server.convert_megatron.MegatronToHF`)
inside a fresh slot and publishes it. Readers see the whole version or none of it.

A version is assembled one at a time: a piece of version ``v + 1`` while ``v`` still
waits for senders is refused, never mixed in. The trainer makes that impossible in normal
operation (each rank waits for its Push before its next optimizer step, and the ranks meet
in a collective after that), so a refusal means a lost sender and is reported loudly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from parameter_server.convert_megatron import GPTConfig, MegatronToHF
from parameter_server.errors import LayoutMismatchError, PushVersionError
from parameter_server.layout import Layout
from parameter_server.store import VersionedStore

logger = logging.getLogger(__name__)


def declaration(config: GPTConfig, tp: int, senders: int) -> dict[str, Any]:
    """What the trainer ranks tell the PS about a sharded Push (plain data for the wire)."""
    return {"kind": "megatron", "config": asdict(config), "tp": tp, "senders": senders}


class ShardAssembler:
    """Gathers the shards of each version from ``senders`` senders into ``store``."""

    def __init__(self, store: VersionedStore, converter: MegatronToHF, senders: int) -> None:
        if senders < 1:
            raise ValueError(f"senders={senders}; a sharded Push needs at least one sender")
        _check_target(store.layout, converter.target_layout)
        self.store = store
        self.converter = converter
        self.senders = senders
        self.staging: Layout = converter.staging_layout()
        self._buffer = np.empty(self.staging.nbytes, dtype=np.uint8)
        self._payload = sum(spec.nbytes for spec in self.staging)
        self._lock = threading.Lock()
        self._version: int | None = None
        self._done: set[int] = set()
        self._received = 0

    @classmethod
    def from_declaration(cls, store: VersionedStore, decl: Mapping[str, Any]) -> ShardAssembler:
        if decl.get("kind") != "megatron":
            raise LayoutMismatchError(f"unknown sharded-Push source {decl.get('kind')!r}")
        converter = MegatronToHF(GPTConfig(**decl["config"]), int(decl["tp"]))
        return cls(store, converter, int(decl["senders"]))

    def matches(self, decl: Mapping[str, Any]) -> bool:
        return declaration(self.converter.config, self.converter.tp_size, self.senders) == dict(
            decl
        )

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._version is not None

    def receive(
        self,
        version: int,
        sender: int,
        ranges: list[tuple[int, int]],
        fill: Callable[[np.ndarray], None],
    ) -> int | None:
        """Take sender ``sender``'s pieces of ``version``: ``fill`` writes the bytes of each
        range (in order) into the staging views it is given. Returns the version once it is
        published (this was the last sender), else None."""
        self._begin(version, sender, ranges)
        total = 0
        for start, stop in ranges:
            fill(self._buffer[start:stop])
            total += stop - start
        return self._finish(version, sender, total)

    def _begin(self, version: int, sender: int, ranges: list[tuple[int, int]]) -> None:
        if not 0 <= sender < self.senders:
            raise LayoutMismatchError(
                f"sender {sender} is outside the {self.senders} declared senders"
            )
        if any(not 0 <= a <= b <= self.staging.nbytes for a, b in ranges):
            raise LayoutMismatchError(f"byte ranges {ranges[:3]} fall outside the staging layout")
        with self._lock:
            if self._version is None:
                latest = self.store.latest
                if latest is not None and version != latest + 1:
                    raise PushVersionError(
                        f"sharded Push of version {version} but the latest is {latest}; "
                        f"versions advance by one (push {latest + 1})"
                    )
                self._version = version
            elif version != self._version:
                missing = sorted(set(range(self.senders)) - self._done)
                raise PushVersionError(
                    f"sender {sender} pushes version {version} while version {self._version} "
                    f"still waits for senders {missing}; a trainer rank was lost"
                )
            if sender in self._done:
                raise PushVersionError(f"sender {sender} already pushed version {version}")

    def _finish(self, version: int, sender: int, nbytes: int) -> int | None:
        with self._lock:
            self._done.add(sender)
            self._received += nbytes
            if len(self._done) < self.senders:
                return None
            received, self._received = self._received, 0
            self._done.clear()
            self._version = None
            if received != self._payload:
                raise LayoutMismatchError(
                    f"version {version}: the senders sent {received} bytes of shards, the model "
                    f"has {self._payload}; every piece must be sent exactly once (same plan "
                    "on every rank)"
                )
            # The slot is written under the store's write lease: readers never see it
            # before commit, and an error aborts it, keeping the latest version intact.
            with self.store.begin_push(version) as lease:
                shards = self.converter.staging_shards(self.staging.views(self._buffer))
                target = self.store.layout.views(lease.view)
                self.converter.convert_into(shards, target)
            logger.debug("sharded Push of version %d from %d senders", version, self.senders)
            return version


def _check_target(store_layout: Layout, target: Layout) -> None:
    """The converter must produce exactly the store's parameters (any order)."""
    have = {s.name: (s.shape, s.dtype) for s in store_layout}
    want = {s.name: (s.shape, s.dtype) for s in target}
    if have == want:
        return
    missing = sorted(set(have) - set(want))[:3]
    extra = sorted(set(want) - set(have))[:3]
    differ = [n for n in sorted(set(have) & set(want)) if have[n] != want[n]][:3]
    raise LayoutMismatchError(
        "the trainer's Megatron shards convert to a different model than the PS holds: "
        f"PS-only {missing}, trainer-only {extra}, "
        + ", ".join(f"{n} {have[n]} vs {want[n]}" for n in differ)
        + "; build the trainer from the same HF config and dtype as the PS layout"
    )
