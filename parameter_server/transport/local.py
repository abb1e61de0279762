"""In-process transport: a thin Transport face on a VersionedStore (tests, embedded mode)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parameter_server.layout import Layout, Slice
from parameter_server.store import StoreInfo, VersionedStore, Weights


class LocalTransport:
    """Pull/Push straight against a store in this process."""

    name = "local"

    def __init__(self, store: VersionedStore) -> None:
        self._store = store
        self.layout: Layout = store.layout
        self.base_layout: Layout | None = store.base_layout

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        return self._store.pull(dest, version)

    def pull_slices(
        self, dest: np.ndarray, slices: Sequence[Slice], version: int | None = None
    ) -> int:
        return self._store.pull_slices(dest, slices, version)

    def push(self, weights: Weights, version: int | None = None) -> int:
        return self._store.push(weights, version)

    def pull_base(self, dest: np.ndarray) -> None:
        self._store.pull_base(dest)

    def push_base(self, weights: Weights) -> None:
        self._store.push_base(weights)

    def info(self) -> StoreInfo:
        return self._store.info()

    def close(self) -> None:
        pass

    def __enter__(self) -> LocalTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
