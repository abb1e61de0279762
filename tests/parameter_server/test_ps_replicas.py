"""Replicated PS workers: group Push, planned Pull of one version from all replicas."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from parameter_server.errors import LayoutMismatchError, PushVersionError, VersionNotHeldError
from parameter_server.layout import Layout, Slice
from parameter_server.plan import Link
from parameter_server.replicas import ReplicaGroup
from parameter_server.store import VersionedStore
from parameter_server.transport import connect
from parameter_server.transport.local import LocalTransport
from parameter_server.worker import PSWorker

WeightsFactory = Callable[[float], dict[str, np.ndarray]]


def random_weights(layout: Layout, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    return {s.name: rng.integers(0, 1000, s.shape).astype(views[s.name].dtype) for s in layout}


def check(layout: Layout, dest: np.ndarray, weights: dict[str, np.ndarray]) -> None:
    for name, view in layout.views(dest).items():
        np.testing.assert_array_equal(view, weights[name], err_msg=name)


@pytest.fixture
def stores(layout: Layout) -> dict[str, VersionedStore]:
    return {"ps0": VersionedStore(layout), "ps1": VersionedStore(layout)}


def test_group_push_then_planned_pull(layout: Layout, stores: dict[str, VersionedStore]):
    with ReplicaGroup({n: LocalTransport(s) for n, s in stores.items()}) as group:
        weights = random_weights(layout, 1)
        assert group.push(weights) == 0
        assert all(s.versions() == (0,) for s in stores.values())
        plan = group.plan()
        assert {t.sender for t in plan.transfers} == {"ps0", "ps1"}  # the load is shared
        assert group.plan() is plan  # computed once, reused
        dest = np.zeros(layout.nbytes, np.uint8)
        assert group.pull(dest) == 0
        check(layout, dest, weights)


def test_pull_slices_touches_only_those_bytes(layout: Layout, stores) -> None:
    store = stores["ps0"]
    weights = random_weights(layout, 2)
    store.push(weights)
    dest = np.full(layout.nbytes, 0xAB, np.uint8)
    store.pull_slices(dest, [layout.slice("embed"), layout.row_slices("layer.0.weight", 4)[1]])
    views = layout.views(dest)
    np.testing.assert_array_equal(views["embed"], weights["embed"])
    np.testing.assert_array_equal(views["layer.0.weight"][2:4], weights["layer.0.weight"][2:4])
    assert (views["layer.0.weight"][:2].view(np.uint8) == 0xAB).all()
    assert (views["steps"].view(np.uint8) == 0xAB).all()
    with pytest.raises(LayoutMismatchError, match="not inside"):
        store.pull_slices(dest, [Slice("embed", (1000,), "float32", 0, 4 * 1000)])


def test_pull_of_a_version_one_replica_lacks(layout: Layout, stores) -> None:
    stores["ps0"].push(random_weights(layout, 0), 5)
    stores["ps1"].push(random_weights(layout, 0), 6)
    with ReplicaGroup({n: LocalTransport(s) for n, s in stores.items()}) as group:
        dest = np.zeros(layout.nbytes, np.uint8)
        with pytest.raises(VersionNotHeldError, match="every replica"):
            group.pull(dest)
        with pytest.raises(VersionNotHeldError):
            group.pull(dest, 5)
        with pytest.raises(PushVersionError, match="different versions"):
            group.push(random_weights(layout, 3))
        assert stores["ps0"].versions() == (5,) and stores["ps1"].versions() == (6,)


def test_bad_group_push_changes_no_replica(layout: Layout, stores, make_weights) -> None:
    with ReplicaGroup({n: LocalTransport(s) for n, s in stores.items()}) as group:
        group.push(make_weights(1))
        bad = make_weights(2)
        del bad["embed"]
        with pytest.raises(LayoutMismatchError):
            group.push(bad)
        assert all(s.versions() == (0,) for s in stores.values())


def test_profiled_links_steer_slices_to_the_fast_replica(layout: Layout, stores) -> None:
    links = {("near", "me"): Link(20e9), ("far", "me"): Link(1e9, 1e-3)}
    replicas = {"far": LocalTransport(stores["ps0"]), "near": LocalTransport(stores["ps1"])}
    with ReplicaGroup(replicas, receiver="me", links=links) as group:
        assert {t.sender for t in group.plan().transfers} == {"near"}


def test_replicas_in_two_worker_processes(layout: Layout) -> None:
    with PSWorker.start(layout) as w0, PSWorker.start(layout) as w1:
        group = ReplicaGroup(
            {"ps0": connect(w0.endpoint, "shm"), "ps1": connect(w1.endpoint, "socket")}
        )
        with group:
            first, second = random_weights(layout, 4), random_weights(layout, 5)
            group.push(first)
            group.push(second)
            dest = np.zeros(layout.nbytes, np.uint8)
            assert group.pull(dest) == 1
            check(layout, dest, second)
            assert group.pull(dest, 0) == 0
            check(layout, dest, first)
