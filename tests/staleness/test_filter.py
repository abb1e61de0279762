"""Filtering occupied groups (dynamic sampling, paper §4.3 and Figure 8c): the operation
of the staleness manager, its atomic form inside Occupy, and its checkpoint.
(``test_protocol_properties.py`` drives both forms in long random sequences.)"""

from __future__ import annotations

import pytest

from staleness import (
    BufferState,
    NotOccupied,
    StalenessConfig,
    StalenessManager,
    UnknownGroup,
)

W, R_, S = BufferState.WAITING, BufferState.READY, BufferState.STUCK


def states(m: StalenessManager) -> list[tuple[int, BufferState, int, int]]:
    return [(b.version, b.state, b.occupied, b.reserved) for b in m.view().buffers]


def _occupied(m: StalenessManager, *groups: int, v: int = 0) -> None:
    for g in groups:
        m.reserve(g, g, v)
        assert m.complete(g, g).occupied


def test_filter_moves_later_occupied_groups_forward_and_counts_apart_from_aborts():
    """Figure 8c: the trainer's buffer loses a group and takes one from the next buffer, so
    it is Ready again without a new trajectory; the hole ends up in the latest buffer."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2))
    _occupied(m, 0, 1, 2)
    assert states(m) == [(0, R_, 2, 0), (1, W, 1, 0)]
    out = m.filter(0)
    assert out.filtered and out.kept == (0,) and out.ready
    assert not out.abort_trajectories and not out.abort_groups
    assert states(m) == [(0, R_, 2, 0), (1, W, 0, 0)]
    view = m.view()
    assert view.filtered_groups == 1 and view.aborted_groups == 0
    assert [g.group_id for g in m.consume().groups] == [1, 2]


def test_the_freed_entry_takes_a_new_reserve_within_the_bound():
    m = StalenessManager(StalenessConfig(eta=0, batch_size=2))
    _occupied(m, 0, 1)
    assert not m.verify(0)  # buffer 0 is full
    m.filter(1)
    assert m.verify(0) and not m.is_ready()
    m.reserve(2, 2, 0)
    assert m.complete(2, 2).ready
    batch = m.consume()
    assert [g.group_id for g in batch.groups] == [0, 2] and set(batch.staleness) == {0}


def test_only_an_occupied_group_is_filtered_and_a_refusal_changes_nothing():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1, group_size=2))
    m.reserve(0, 0, 0)
    m.complete(0, 0)  # 1 of 2: still reserved
    before = m.export_state()
    with pytest.raises(NotOccupied, match="abort a reserved one instead"):
        m.filter(0)
    with pytest.raises(NotOccupied):
        m.filter(7)  # never tracked
    assert m.export_state() == before


def test_a_late_message_about_a_filtered_group_is_discarded():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1, group_size=1, group_redundancy=1.0))
    m.reserve(0, 0, 0)
    m.reserve(0, 1, 0)
    out = m.complete(0, 0)
    assert out.occupied and out.abort_trajectories == (1,)
    m.filter(0)
    late = m.complete(0, 1)  # the surplus member finishes after all
    assert late.discarded and not late.occupied
    with pytest.raises(UnknownGroup):
        m.abort(99)
    assert m.abort(0).abort_groups == ()  # gone for good: a late abort is a no-op


def test_keep_filters_inside_the_occupy_so_no_reader_sees_the_group():
    """complete(keep=...) decides on the G kept trajectories and filters before the lock
    is released: no ready listener fires, the trainer's buffer never shows it, and the
    group redundancy's surplus is reported for abort as at any Occupy."""
    m = StalenessManager(StalenessConfig(eta=0, batch_size=1, group_size=2, group_redundancy=0.5))
    fired: list[int] = []
    m.add_ready_listener(fired.append)
    asked: list[tuple[int, ...]] = []

    def keep(kept):
        asked.append(tuple(kept))
        return False

    for t in (0, 1, 2):
        m.reserve(0, t, 0)
    assert not m.complete(0, 0, keep=keep).filtered  # 1 of 2: not asked yet
    out = m.complete(0, 2, keep=keep)
    assert asked == [(0, 2)]
    assert out.filtered and out.kept == (0, 2) and out.abort_trajectories == (1,)
    assert not out.occupied and not out.ready and not fired
    assert m.trainer_groups() == () and m.view().filtered_groups == 1
    assert m.verify(0)  # its entry is free for a new group
    m.reserve(1, 10, 0)  # a kept group occupies as before
    m.reserve(1, 11, 0)
    m.complete(1, 10, keep=lambda k: True)
    assert m.complete(1, 11, keep=lambda k: True).occupied and fired == [0]


def test_a_keep_that_raises_changes_nothing():
    m = StalenessManager(StalenessConfig(eta=0, batch_size=1, group_size=2))
    m.reserve(0, 0, 0)
    m.reserve(0, 1, 0)
    m.complete(0, 0)
    before = m.export_state()

    def broken(kept):
        raise RuntimeError("reward lookup failed")

    with pytest.raises(RuntimeError):
        m.complete(0, 1, keep=broken)
    assert m.export_state() == before
    assert m.complete(0, 1, keep=lambda kept: True).occupied  # and it can go on


def test_batch_redundancy_surplus_is_discarded_not_filtered():
    """A group with no free occupied slot is surplus before its rewards matter: keep is not
    asked and the group counts as aborted."""
    m = StalenessManager(StalenessConfig(eta=0, batch_size=1, batch_redundancy=1.0))
    m.reserve(0, 0, 0)
    m.reserve(1, 1, 0)
    m.complete(0, 0)  # buffer Ready; group 1 can no longer fit
    out = m.complete(1, 1, keep=lambda k: pytest.fail("asked about surplus"))
    assert out.discarded and not out.filtered
    assert m.view().filtered_groups == 0


def test_filtered_counts_survive_a_round_trip_and_the_step_count_resets_at_consume():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1))
    _occupied(m, 0, 1)
    m.filter(0)
    _occupied(m, 2)
    m.filter(1)
    restored = StalenessManager.restore(m.export_state())
    assert restored.export_state() == m.export_state()
    assert (restored.filtered_groups, restored.filtered_this_step) == (2, 2)
    restored.consume()
    assert (restored.filtered_groups, restored.filtered_this_step) == (2, 0)
    # a state written before dynamic sampling (format 2) restores with nothing filtered
    old = {k: v for k, v in m.export_state().items() if not k.startswith("filtered")}
    old["format"] = 2
    assert StalenessManager.restore(old).view().filtered_groups == 0
