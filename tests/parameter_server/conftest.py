"""Fixtures of the parameter-server tests.

Fakes: none. Workers are real spawned processes with real shared memory; the
session fixture fails the run if any segment or socket outlives the tests.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from parameter_server.layout import Layout, ParamSpec
from parameter_server.worker import PSWorker


def leftovers(pid: int) -> set[str]:
    """Segments and sockets of workers started by process ``pid`` (names carry the pid)."""
    return set(glob.glob(f"/dev/shm/staleflow-ps-{pid}-*")) | set(
        glob.glob(f"/tmp/staleflow-ps-{pid}-*.sock")
    )


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments() -> Iterator[None]:
    # Filtered by our pid: other sessions on the machine may run workers meanwhile.
    before = leftovers(os.getpid())
    yield
    leaked = leftovers(os.getpid()) - before
    assert not leaked, f"shared memory or sockets leaked: {sorted(leaked)}"


def small_weights(fill: float = 0.0) -> dict[str, np.ndarray]:
    """A few parameters of mixed shapes and dtypes (odd sizes exercise padding)."""
    return {
        "embed": np.full((17, 8), fill, dtype=np.float32),
        "layer.0.weight": np.full((8, 8), fill, dtype=np.float32),
        "layer.0.bias": np.full((8,), fill, dtype=np.float16),
        "bf16": np.full((3, 5), int(fill) % 65536, dtype=np.uint16),
        "steps": np.full((3,), int(fill), dtype=np.int64),
    }


def small_layout() -> Layout:
    w = small_weights()
    layout = Layout.from_arrays({k: v for k, v in w.items() if k != "bf16"})
    specs = [*layout.specs]
    specs.insert(3, ParamSpec("bf16", (3, 5), "bfloat16"))
    return Layout(specs)


@pytest.fixture(scope="session")
def layout() -> Layout:
    return small_layout()


@pytest.fixture(scope="session")
def make_weights() -> Callable[[float], dict[str, np.ndarray]]:
    return small_weights


@pytest.fixture(scope="module")
def worker(layout: Layout) -> Iterator[PSWorker]:
    """One worker process (no NIXL) shared by a test module."""
    w = PSWorker.start(layout, num_slots=3)
    try:
        yield w
    finally:
        w.stop()
