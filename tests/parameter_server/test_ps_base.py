"""Adapter versions over a frozen base (``trainer.lora``): a store holds the base once,
written once, beside its slots; every version (Push, Pull) is the adapter alone. In
process and across a real worker over shm and socket."""

from __future__ import annotations

import time

import numpy as np
import pytest

from parameter_server import wire
from parameter_server.errors import BaseWeightsError, LayoutMismatchError
from parameter_server.layout import Layout
from parameter_server.store import VersionedStore, required_bytes, slot_stride
from parameter_server.transport import connect
from parameter_server.transport.base import ControlClient
from parameter_server.worker import PSWorker


def _base(fill: float) -> dict[str, np.ndarray]:
    return {
        "model.embed_tokens.weight": np.full((50, 16), fill, np.float32),
        "model.layers.0.self_attn.q_proj.weight": np.full((16, 16), fill, np.float32),
    }


def _adapter(fill: float) -> dict[str, np.ndarray]:
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        f"{stem}.lora_A.weight": np.full((2, 16), fill, np.float32),
        f"{stem}.lora_B.weight": np.full((16, 2), fill, np.float32),
    }


BASE = Layout.from_arrays(_base(0))
ADAPTER = Layout.from_arrays(_adapter(0))


def _unpack(layout: Layout, buffer: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in layout.views(buffer).items()}


def test_the_store_holds_the_base_once_beside_the_adapter_versions():
    store = VersionedStore(ADAPTER, num_slots=2, base=BASE)
    assert store.memory.nbytes == required_bytes(ADAPTER, 2, BASE)
    assert store.base_offset == 2 * slot_stride(ADAPTER)
    info = store.info()
    assert (info.version_bytes, info.base_bytes, info.base_ready) == (
        ADAPTER.nbytes,
        BASE.nbytes,
        False,
    )
    with pytest.raises(BaseWeightsError, match="not pushed to this PS yet"):
        store.pull_base(np.empty(BASE.nbytes, np.uint8))
    store.push_base(_base(3))
    assert store.info().base_ready
    with pytest.raises(BaseWeightsError, match="written once per store"):
        store.push_base(_base(4))
    # versions cycle through the slots; the base is never touched
    for v in range(5):
        store.push(_adapter(v))
    dest = np.empty(ADAPTER.nbytes, np.uint8)
    assert store.pull(dest) == 4
    assert _unpack(ADAPTER, dest)[next(iter(_adapter(0)))][0, 0] == 4
    base = np.empty(BASE.nbytes, np.uint8)
    store.pull_base(base)
    for name, value in _unpack(BASE, base).items():
        np.testing.assert_array_equal(value, _base(3)[name])


def test_a_base_that_does_not_fit_changes_nothing_and_a_store_without_base_refuses_one():
    store = VersionedStore(ADAPTER, num_slots=2, base=BASE)
    with pytest.raises(LayoutMismatchError):
        store.push_base(_adapter(1))
    assert not store.info().base_ready
    store.push_base(_base(1))  # still writable: the bad Push reserved nothing
    plain = VersionedStore(ADAPTER, num_slots=2)
    with pytest.raises(BaseWeightsError, match="no base"):
        plain.push_base(_base(1))
    assert plain.info().base_bytes == 0


@pytest.fixture(scope="module")
def adapter_worker():
    w = PSWorker.start(ADAPTER, num_slots=2, base=BASE)
    try:
        yield w
    finally:
        w.stop()


def test_across_processes_the_base_moves_once_and_a_pull_moves_the_adapter(adapter_worker):
    with (
        connect(adapter_worker.endpoint, "socket") as sock,
        connect(adapter_worker.endpoint, "shm") as shm,
    ):
        assert shm.base_layout == BASE and sock.base_layout == BASE
        with pytest.raises(BaseWeightsError, match="not pushed"):
            sock.pull_base(np.empty(BASE.nbytes, np.uint8))
        shm.push_base(_base(7))
        with pytest.raises(BaseWeightsError, match="once"):
            sock.push_base(_base(8))
        for t in (shm, sock):
            got = np.zeros(BASE.nbytes, np.uint8)
            t.pull_base(got)
            for name, value in _unpack(BASE, got).items():
                np.testing.assert_array_equal(value, _base(7)[name])
        sock.push(_adapter(1), 0)
        shm.push(_adapter(2), 1)
        dest = np.zeros(ADAPTER.nbytes, np.uint8)  # a version is the adapter's bytes only
        assert sock.pull(dest) == 1
        assert _unpack(ADAPTER, dest)[next(iter(_adapter(0)))][0, 0] == 2
        info = shm.info()
        assert (info.version_bytes, info.base_bytes, info.base_ready) == (
            ADAPTER.nbytes,
            BASE.nbytes,
            True,
        )


def test_a_client_that_dies_writing_the_base_leaves_it_writable():
    with PSWorker.start(ADAPTER, num_slots=2, base=BASE) as w:
        control = ControlClient(w.endpoint)
        control.expect(control.request(wire.BeginBase()), wire.Leased)
        control.close()  # gone mid-write: the worker aborts the base push
        with connect(w.endpoint, "socket") as t:
            for _ in range(100):
                try:
                    t.push_base(_base(5))
                    break
                except BaseWeightsError:  # the worker has not noticed the close yet
                    time.sleep(0.02)
            assert t.info().base_ready


def test_a_full_weight_worker_refuses_base_calls_before_asking(worker, layout):
    with connect(worker.endpoint, "socket") as t:
        assert t.base_layout is None
        with pytest.raises(BaseWeightsError, match="no base"):
            t.pull_base(np.empty(8, np.uint8))


def test_a_replica_group_gives_the_base_to_the_replicas_that_lack_it(adapter_worker):
    from parameter_server.replicas import ReplicaGroup

    with PSWorker.start(ADAPTER, num_slots=2, base=BASE) as fresh:  # a restarted replica
        group = ReplicaGroup(
            {
                "ps/0": connect(adapter_worker.endpoint, "socket"),
                "ps/1": connect(fresh.endpoint, "shm"),
            }
        )
        with group:
            assert group.base_layout == BASE
            if not group.replica("ps/0").info().base_ready:
                group.replica("ps/0").push_base(_base(7))
            assert group.push_base(_base(7)) == 1  # only the fresh one took it
            assert group.push_base(_base(7)) == 0
            got = np.zeros(BASE.nbytes, np.uint8)
            group.pull_base(got)
            np.testing.assert_array_equal(
                _unpack(BASE, got)["model.embed_tokens.weight"],
                _base(7)["model.embed_tokens.weight"],
            )
    with PSWorker.start(ADAPTER, num_slots=2) as plain:
        a, b = connect(adapter_worker.endpoint, "socket"), connect(plain.endpoint, "socket")
        with a, b, pytest.raises(LayoutMismatchError, match="base"):
            ReplicaGroup({"a": a, "b": b})
