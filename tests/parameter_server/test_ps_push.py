"""Background Push: returns at once, publishes in order, reports errors through the handle."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from parameter_server.errors import PushVersionError
from parameter_server.layout import Layout
from parameter_server.push import BackgroundPusher
from parameter_server.store import VersionedStore, Weights

WeightsFactory = Callable[[float], dict[str, np.ndarray]]


class GatedTarget:
    """A push target that blocks until the test opens the gate (fakes a slow copy)."""

    def __init__(self, store: VersionedStore) -> None:
        self.store = store
        self.gate = threading.Event()
        self.started = threading.Event()

    def push(self, weights: Weights, version: int | None = None) -> int:
        self.started.set()
        self.gate.wait()
        return self.store.push(weights, version)


def test_push_async_returns_before_the_copy_and_wait_fences_it(
    layout: Layout, make_weights: WeightsFactory
) -> None:
    store = VersionedStore(layout)
    target = GatedTarget(store)
    with BackgroundPusher(target) as pusher:
        handle = pusher.push_async(0, make_weights(5))
        target.started.wait()
        assert not handle.done() and store.latest is None
        with pytest.raises(TimeoutError):
            handle.before_overwrite(timeout=0.05)
        target.gate.set()
        assert handle.before_overwrite() == 0
    assert store.latest == 0
    assert handle.timing is not None and handle.timing.copy_s >= 0


def test_pushes_publish_in_submission_order(layout: Layout, make_weights: WeightsFactory):
    store = VersionedStore(layout)
    with BackgroundPusher(store) as pusher:
        handles = [pusher.push_async(None, make_weights(v)) for v in range(6)]
        assert [h.wait() for h in handles] == list(range(6))
    dest = np.empty(layout.nbytes, np.uint8)
    assert store.pull(dest) == 5
    assert (layout.views(dest)["embed"] == 5).all()


def test_a_failed_push_reports_through_its_handle_and_the_next_one_works(
    layout: Layout, make_weights: WeightsFactory
) -> None:
    store = VersionedStore(layout)
    store.push(make_weights(0))
    with BackgroundPusher(store) as pusher:
        bad = pusher.push_async(7, make_weights(7))
        good = pusher.push_async(1, make_weights(1))
        with pytest.raises(PushVersionError):
            bad.wait()
        assert isinstance(bad.exception(), PushVersionError)
        assert good.wait() == 1
    assert store.versions() == (0, 1)


def test_push_async_after_close_is_refused(layout: Layout, make_weights: WeightsFactory):
    pusher = BackgroundPusher(VersionedStore(layout))
    pusher.close()
    with pytest.raises(RuntimeError, match="close"):
        pusher.push_async(0, make_weights(0))
