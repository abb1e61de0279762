"""The versioned store: atomic publication, non-blocking Pulls, and bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from parameter_server.errors import (
    DestinationError,
    LayoutMismatchError,
    PushInProgressError,
    PushVersionError,
    VersionNotHeldError,
)
from parameter_server.layout import Layout, ParamSpec
from parameter_server.store import VersionedStore

WeightsFactory = Callable[[float], dict[str, np.ndarray]]


def uniform_layout(n: int = 1 << 20) -> Layout:
    return Layout([ParamSpec("big", (n,), "int32"), ParamSpec("small", (7, 3), "int32")])


def filled(layout: Layout, value: int) -> dict[str, np.ndarray]:
    return {s.name: np.full(s.shape, value, dtype=np.int32) for s in layout}


def snapshot(store: VersionedStore) -> tuple[object, ...]:
    """Everything a bad call must leave alone: held versions, latest, and their bytes."""
    info = store.info()
    contents = []
    for v in info.held:
        dest = np.empty(store.layout.nbytes, np.uint8)
        store.pull(dest, v)
        contents.append(dest.tobytes())
    return info.held, info.latest, info.pushing, tuple(contents)


def test_pull_returns_exactly_what_was_pushed(layout: Layout, make_weights: WeightsFactory):
    store = VersionedStore(layout)
    weights = make_weights(3)
    assert store.push(weights) == 0
    dest = np.zeros(layout.nbytes, np.uint8)
    assert store.pull(dest) == 0
    for name, view in layout.views(dest).items():
        np.testing.assert_array_equal(view, weights[name])


def test_concurrent_pulls_never_see_a_mix_of_versions() -> None:
    """Two reader threads (latest, and the oldest held) race a writer. The race is counted,
    not hoped for: a Pull that saw `finished` = f before it began and `started` = s after
    it ended overlapped a Push when s > f, and the writer pushes until each reader has
    made `overlaps` such Pulls over at least 4 versions (a hang is pytest-timeout's)."""
    layout = uniform_layout()
    store = VersionedStore(layout, num_slots=3)
    store.push(filled(layout, 0))
    pushes = {"started": 0, "finished": 0}  # one writer; readers only read them
    overlaps = 10
    stop = threading.Event()
    begin = threading.Barrier(3)
    overlapping = [0, 0]
    seen: list[set[int]] = [set(), set()]
    failures: list[str] = []

    def reader(i: int, pick_previous: bool) -> None:
        dest = np.empty(layout.nbytes, np.uint8)
        begin.wait()
        while not stop.is_set():
            want = None
            if pick_previous:
                held = store.versions()
                want = held[0] if held else None
            before = pushes["finished"]
            try:
                got = store.pull(dest, want)
            except VersionNotHeldError:
                continue  # the version was retired between versions() and pull()
            overlapping[i] += pushes["started"] > before
            for name, view in layout.views(dest).items():
                if not (view == got).all():
                    failures.append(f"v{got}: {name} holds {np.unique(view)[:5]}")
            seen[i].add(got)

    def raced_enough() -> bool:
        return all(n >= overlaps for n in overlapping) and all(len(s) >= 4 for s in seen)

    readers = [threading.Thread(target=reader, args=(i, i == 1)) for i in range(2)]
    for t in readers:
        t.start()
    begin.wait()
    v = 0
    while not raced_enough():
        v += 1
        pushes["started"] = v
        store.push(filled(layout, v), v)
        pushes["finished"] = v
    stop.set()
    for t in readers:
        t.join()
    assert not failures, failures[:3]
    assert raced_enough(), f"overlapping Pulls {overlapping}, versions seen {seen}"


def test_pull_of_latest_does_not_wait_for_a_push_in_flight() -> None:
    layout = uniform_layout(1024)
    store = VersionedStore(layout, num_slots=2)
    store.push(filled(layout, 7), 7)
    lease = store.begin_push(8)  # a Push stuck half way, held by this very thread
    try:
        assert store.versions() == (7,)
        dest = np.empty(layout.nbytes, np.uint8)
        # a Pull that waited for the Push would wait for this thread: it would never return
        assert store.pull(dest) == 7
        assert (layout.views(dest)["big"] == 7).all()
        lease.view[:] = 0
    finally:
        lease.abort()


def test_push_waits_for_readers_of_the_slot_it_needs() -> None:
    layout = uniform_layout(1024)
    store = VersionedStore(layout, num_slots=2)
    store.push(filled(layout, 0))
    store.push(filled(layout, 1))
    reading = store.acquire_read(0)  # pins the only slot a Push may use
    pushed = threading.Event()

    def push() -> None:
        store.push(filled(layout, 2))
        pushed.set()

    threading.Thread(target=push).start()
    # wait until the Push is under way (it has retired v0 and holds the Push flag), then
    # it can only be waiting for the reader: it must not have finished or written
    while not store.info().pushing:  # (a Push that never starts: pytest-timeout)
        time.sleep(0.001)
    assert store.versions() == (1,)
    assert not pushed.is_set(), "Push overwrote a slot that was being read"
    assert (reading.view.view(np.int32)[:1024] == 0).all()
    with pytest.raises(VersionNotHeldError):  # already retired: no new reader gets v0
        store.acquire_read(0)
    reading.release()
    pushed.wait()
    assert store.versions() == (1, 2)


def test_versions_held_follow_the_slots(layout: Layout, make_weights: WeightsFactory) -> None:
    store = VersionedStore(layout, num_slots=3)
    assert store.versions() == () and store.latest is None
    for v in range(5):
        store.push(make_weights(v))
    assert store.versions() == (2, 3, 4) and store.latest == 4
    with store.begin_push() as lease:
        assert lease.version == 5
        assert store.versions() == (3, 4)  # the oldest is retired, the last two stay readable
        lease.view[:] = 0
    assert store.versions() == (3, 4, 5)


def test_first_push_may_start_at_any_version(layout: Layout, make_weights: WeightsFactory):
    store = VersionedStore(layout)
    assert store.push(make_weights(0), 41) == 41
    assert store.push(make_weights(0)) == 42


# -- bad input never changes state -----------------------------------------------------


@pytest.fixture
def busy_store(layout: Layout, make_weights: WeightsFactory) -> VersionedStore:
    store = VersionedStore(layout, num_slots=3)
    for v in range(4):
        store.push(make_weights(v))
    return store


def test_pull_of_missing_or_retired_version(busy_store: VersionedStore) -> None:
    before = snapshot(busy_store)
    dest = np.empty(busy_store.layout.nbytes, np.uint8)
    for v in (0, 99, -1):
        with pytest.raises(VersionNotHeldError, match=r"held: \[1, 2, 3\]"):
            busy_store.pull(dest, v)
    assert snapshot(busy_store) == before


def test_pull_before_any_push(layout: Layout) -> None:
    with pytest.raises(VersionNotHeldError, match="Push version 0"):
        VersionedStore(layout).pull(np.empty(layout.nbytes, np.uint8))


@pytest.mark.parametrize(
    "dest",
    [
        np.empty(10, np.uint8),
        np.empty(0, np.uint8),
        "bytes",
    ],
)
def test_pull_into_wrong_destination(busy_store: VersionedStore, dest: object) -> None:
    before = snapshot(busy_store)
    with pytest.raises(DestinationError):
        busy_store.pull(dest)  # type: ignore[arg-type]
    assert snapshot(busy_store) == before


def test_pull_into_non_contiguous_destination(busy_store: VersionedStore) -> None:
    dest = np.empty(2 * busy_store.layout.nbytes, np.uint8)[::2]
    with pytest.raises(DestinationError, match="contiguous"):
        busy_store.pull(dest)


def _drop(w: dict[str, np.ndarray]) -> None:
    del w["embed"]


def _add(w: dict[str, np.ndarray]) -> None:
    w["surprise"] = np.zeros(2, np.float32)


def _reshape(w: dict[str, np.ndarray]) -> None:
    w["embed"] = np.zeros((8, 17), np.float32)


def _retype(w: dict[str, np.ndarray]) -> None:
    w["layer.0.bias"] = w["layer.0.bias"].astype(np.float32)


def _listify(w: dict[str, np.ndarray]) -> None:
    w["steps"] = [0, 0, 0]  # type: ignore[assignment]


@pytest.mark.parametrize("corrupt", [_drop, _add, _reshape, _retype, _listify])
def test_push_that_does_not_match_the_layout(
    busy_store: VersionedStore, make_weights: WeightsFactory, corrupt: Callable
) -> None:
    before = snapshot(busy_store)
    weights = make_weights(9)
    corrupt(weights)
    with pytest.raises(LayoutMismatchError):
        busy_store.push(weights)
    assert snapshot(busy_store) == before
    assert busy_store.push(make_weights(4)) == 4  # and the store still works


def test_push_of_wrong_packed_size_or_version(
    busy_store: VersionedStore, make_weights: WeightsFactory
) -> None:
    before = snapshot(busy_store)
    with pytest.raises(LayoutMismatchError, match="bytes"):
        busy_store.push(np.zeros(busy_store.layout.nbytes + 1, np.uint8))
    for v in (3, 5, 0):
        with pytest.raises(PushVersionError, match="push version 4 next"):
            busy_store.push(make_weights(9), v)
    assert snapshot(busy_store) == before


def test_second_push_while_one_is_in_flight(busy_store: VersionedStore, make_weights):
    lease = busy_store.begin_push()
    with pytest.raises(PushInProgressError):
        busy_store.push(make_weights(9))
    lease.abort()
    assert busy_store.versions() == (2, 3)  # abort gives the slot back empty
    assert busy_store.push(make_weights(4)) == 4


def test_store_needs_two_slots(layout: Layout) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        VersionedStore(layout, num_slots=1)


def test_push_lease_times_out_on_a_stuck_reader() -> None:
    layout = uniform_layout(64)
    store = VersionedStore(layout, num_slots=2)
    store.push(filled(layout, 0))
    store.push(filled(layout, 1))
    stuck = store.acquire_read(0)
    # the reader is never released while begin_push waits: ignoring the timeout would hang
    with pytest.raises(TimeoutError, match="num_slots"):
        store.begin_push(timeout=0.2)
    assert store.versions() == (0, 1)  # a timed-out Push changes nothing
    stuck.release()
    assert store.push(filled(layout, 2)) == 2
