"""Unit tests of the staleness manager's primitives, misuse and introspection."""

from __future__ import annotations

import random
import threading
import time

import pytest

from staleness import (
    BufferState,
    CorruptState,
    DuplicateTrajectory,
    InvalidConfig,
    NotReady,
    NotReserved,
    StalenessConfig,
    StalenessError,
    StalenessManager,
    StalenessViolation,
    UnknownGroup,
)
from staleness.bounds import MAX_ETA


def states(m: StalenessManager) -> list[tuple[int, BufferState, int, int]]:
    return [(b.version, b.state, b.occupied, b.reserved) for b in m.view().buffers]


W, R_, S = BufferState.WAITING, BufferState.READY, BufferState.STUCK


# -- configuration and misuse ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eta": -1}, "eta=-1 is negative: use 0 for synchronous RL"),
        ({"batch_size": 0}, "batch_size=0 is too small: use at least 1 group"),
        ({"group_size": 0}, "group_size=0 is too small: use at least 1 trajectory"),
        (
            {"batch_redundancy": -0.5},
            r"batch_redundancy=-0.5 is out of range: use a ratio in \[0, 16\)",
        ),
        ({"eta": 1.5}, "eta=1.5 is not an integer"),
    ],
)
def test_bad_config_is_rejected_with_the_fix(kwargs, match):
    with pytest.raises(InvalidConfig, match=match):
        StalenessManager(StalenessConfig(**kwargs))


def _misuse_cases():
    def unknown_complete(m):
        m.complete(99, 0)

    def unknown_abort(m):
        m.abort(99)

    def double_reserve(m):
        m.reserve(0, 0, 0)

    def occupy_without_reserve(m):
        m.complete(0, 7)

    def consume_not_ready(m):
        m.consume()

    def future_version(m):
        m.reserve(5, 5, 3)

    def too_stale(m):
        m.reserve(5, 5, -1)

    return [
        (unknown_complete, UnknownGroup),
        (unknown_abort, UnknownGroup),
        (double_reserve, DuplicateTrajectory),
        (occupy_without_reserve, NotReserved),
        (consume_not_ready, NotReady),
        (future_version, StalenessError),
        (too_stale, StalenessError),
    ]


@pytest.mark.parametrize(("call", "error"), _misuse_cases())
def test_misuse_raises_typed_error_and_changes_nothing(call, error):
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2))
    m.reserve(0, 0, 0)
    before = m.export_state()
    with pytest.raises(error) as info:
        call(m)
    assert str(info.value)  # the message says what was wrong
    assert m.export_state() == before


def test_double_completion_is_rejected():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2, group_size=2))
    m.reserve(0, 0, 0)
    m.reserve(0, 1, 0)
    m.complete(0, 0)
    with pytest.raises(DuplicateTrajectory):
        m.complete(0, 0)


def test_rejection_message_names_the_fix():
    m = StalenessManager(StalenessConfig(eta=0, batch_size=1))
    m.reserve(0, 0, 0)
    with pytest.raises(StalenessViolation, match="newer version or wait"):
        m.reserve(1, 1, 0)


# -- Figure 7 (eta = 1), reconstructed step by step ---------------------------------------


def test_figure7_walkthrough():
    """Our reconstruction of Figure 7 (left): eta = 1, batch size 4, three instances with
    up to three concurrent trajectories each, all at version V1 at T1."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=4), version=1)
    # T1: instance 1 starts trajectories 1-3, instance 2 starts 4-6, all with V_traj = V1.
    # Worst-case Reserve fills the latest buffer first.
    for t in range(1, 7):
        assert m.verify(1)
        m.reserve(t, t, 1)
    assert states(m) == [(1, W, 0, 2), (2, S, 0, 4)]
    # T1': trajectories 1, 2 and 4 complete; Occupy takes the earliest entries and the
    # reserved ones move to the later buffer (entry movement of Figure 7 right).
    for t in (1, 2, 4):
        m.complete(t, t)
    assert states(m) == [(1, W, 3, 0), (2, W, 0, 3)]
    # T2: buffers V1..V2 are Waiting, so trajectory 7 may still get V_traj = V1 on
    # instance 1 (and 8 on instance 3).
    assert m.verify(1)
    m.reserve(7, 7, 1)
    m.reserve(8, 8, 1)
    assert states(m) == [(1, S, 3, 1), (2, S, 0, 4)]
    assert not m.verify(1)
    # Trajectory 3 completes: buffer V1 is Ready and training consumes it.
    assert m.complete(3, 3).ready
    assert states(m) == [(1, R_, 4, 0), (2, S, 0, 4)]
    batch = m.consume()
    assert batch.version == 1 and sorted(g.group_id for g in batch.groups) == [1, 2, 3, 4]
    # T2': buffer V2 is Stuck: instance 1 (still at V1) may not start more trajectories,
    # while instance 2, synced to V2, may (buffer V3 is not Stuck).
    assert states(m) == [(2, S, 0, 4), (3, W, 0, 0)]
    assert not m.verify(1)
    assert m.verify(2)
    # Trajectory 5 undergoes partial rollout (interrupt, sync to V2, resume): no protocol
    # call, and its reserved entry with V_traj = V1 stays in buffer V2.
    entries = {e.group_id: (b.version, e.version) for b in m.view().buffers for e in b.entries}
    assert entries[5] == (2, 1)


def test_paper_reserve_scan_is_not_exact_but_ours_is():
    """Counter-example to the paper's physical procedure: it places reservations at the
    latest empty entry and moves nothing on abort, so an early slot can stay blocked by a
    reservation that could sit later. eta = 1, batch size 1, trainer at version 1.

    Paper: R_x (V1) -> buffer 2; R_y (V1) -> buffer 1 (2 is full); abort R_x empties
    buffer 2. A new trajectory with V_traj = V0 may only use buffer 1, which R_y holds, so
    the backward scan finds no empty entry and refuses. Yet R_y can move to buffer 2.
    """
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1), version=1)
    m.reserve(10, 10, 1)  # R_x
    m.reserve(11, 11, 1)  # R_y
    m.abort(10)
    assert m.verify(0)
    m.reserve(12, 12, 0)
    assert states(m) == [(1, S, 0, 1), (2, S, 0, 1)]


def test_reserve_never_pushes_an_occupied_group_later():
    """A Ready buffer stays Ready: a stale Reserve may not displace its occupied groups,
    even though a placement exists where the occupied group moves to the next buffer."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1), version=1)
    m.reserve(0, 0, 1)
    m.complete(0, 0)
    assert m.is_ready()
    assert not m.verify(0)  # V0 fits only in buffer 1, which is Ready
    assert m.verify(1)  # buffer 2 is free


# -- groups and redundancy ------------------------------------------------------------------


def test_group_version_is_min_and_occupies_only_when_complete():
    m = StalenessManager(StalenessConfig(eta=2, batch_size=1, group_size=3), version=2)
    m.reserve(7, 70, 2)
    m.reserve(7, 71, 1)
    m.reserve(7, 72, 2)
    assert m.group_version(7) == 1
    assert not m.complete(7, 70).occupied
    assert not m.complete(7, 72).occupied
    assert states(m)[-1][3] + sum(s[3] for s in states(m)[:-1]) == 1  # still reserved
    out = m.complete(7, 71)
    assert out.occupied and out.ready and set(out.kept) == {70, 71, 72}
    batch = m.consume()
    assert batch.groups[0].version == 1 and batch.staleness == (1,)


def test_group_redundancy_reports_surplus_and_raises_version():
    cfg = StalenessConfig(eta=2, batch_size=1, group_size=2, group_redundancy=0.5)
    m = StalenessManager(cfg, version=2)
    m.reserve(1, 10, 0)  # the stale member will be the surplus
    m.reserve(1, 11, 2)
    m.reserve(1, 12, 2)
    with pytest.raises(StalenessViolation, match="already has 3"):
        m.reserve(1, 13, 2)
    m.complete(1, 11)
    out = m.complete(1, 12)
    assert out.occupied and out.abort_trajectories == (10,)
    assert m.complete(1, 10).discarded  # late surplus completion
    assert m.consume().groups[0].version == 2  # the kept members define the version


def test_batch_redundancy_aborts_surplus_groups():
    cfg = StalenessConfig(eta=0, batch_size=2, batch_redundancy=0.5)  # 3 entries per buffer
    m = StalenessManager(cfg)
    for g in range(3):
        m.reserve(g, g, 0)
    assert not m.verify(0)
    m.complete(0, 0)
    out = m.complete(1, 1)
    assert out.ready
    # Group 2 can never be occupied (both occupied slots are taken): reported for abort.
    assert out.abort_groups == (2,)
    assert m.complete(2, 2).discarded
    assert [g.group_id for g in m.consume().groups] == [0, 1]


def test_abort_lets_later_occupied_groups_move_forward():
    """Figure 8c: filtering an entry of the trainer's buffer pulls occupied ones forward."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2), version=1)
    m.reserve(0, 0, 0)  # deadline 0: must be trained in buffer 1
    for g in (1, 2):
        m.reserve(g, g, 1)
    m.complete(1, 1)
    m.complete(2, 2)
    assert states(m) == [(1, S, 1, 1), (2, W, 1, 0)]
    out = m.abort(0)  # e.g. identical rewards: no learning signal
    assert out.ready and out.abort_trajectories == (0,)
    assert states(m) == [(1, R_, 2, 0), (2, W, 0, 0)]


def test_abort_trajectory_drops_group_that_cannot_complete():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1, group_size=2))
    m.reserve(3, 30, 0)
    m.reserve(3, 31, 0)
    out = m.abort_trajectory(3, 30)
    assert out.abort_groups == (3,) and set(out.abort_trajectories) == {30, 31}
    assert m.view().reserved_groups == 0


def test_unreserve_undoes_a_reserve_that_never_started():
    """A Route died with its instance before the trajectory left the TS: its Reserve is
    undone, nothing is dropped, and it can be Reserved again (at another version)."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1, group_size=2), version=1)
    m.reserve(3, 30, 0)
    m.reserve(3, 31, 1)
    before = m.export_state()
    m.unreserve(3, 30)  # the group survives on its other member, at its version
    assert m.group_version(3) == 1 and m.view().reserved_groups == 1
    m.reserve(3, 30, 1)
    m.unreserve(3, 30)
    m.unreserve(3, 31)  # the last member: the group is forgotten, not closed
    assert m.group_version(3) is None and m.view().reserved_groups == 0
    m.reserve(3, 30, 1)  # so it takes Reserves again
    m.reserve(3, 31, 1)
    m.complete(3, 30)
    with pytest.raises(NotReserved, match="not a running member"):
        m.unreserve(3, 30)  # finished: not an unstarted Reserve
    with pytest.raises(NotReserved):
        m.unreserve(9, 90)
    assert m.export_state()["aborted"] == before["aborted"] == []  # nothing was dropped


# -- eta = 0 is synchronous; long random runs respect the bound ------------------------------


def drive(cfg: StalenessConfig, steps: int, seed: int, instances: int = 4):
    """A toy cluster: instances lag behind the trainer, trajectories finish at random."""
    rng = random.Random(seed)
    m = StalenessManager(cfg)
    inst_version = [0] * instances
    running: list[tuple[int, int]] = []
    next_id = 0
    batches = []
    for _ in range(steps):
        i = rng.randrange(instances)
        if rng.random() < 0.3:
            inst_version[i] = m.version  # the instance pulls the newest weights
        if rng.random() < 0.5 and m.verify(inst_version[i]):
            for t in range(cfg.group_size):
                m.reserve(next_id, next_id * 100 + t, inst_version[i])
                running.append((next_id, next_id * 100 + t))
            next_id += 1
        elif running:
            gid, tid = running.pop(rng.randrange(len(running)))
            m.complete(gid, tid)
        while m.is_ready():
            batches.append(m.consume())
    return batches


@pytest.mark.parametrize("seed", range(5))
def test_eta_zero_is_exactly_on_policy(seed):
    batches = drive(StalenessConfig(eta=0, batch_size=4, group_size=2), 3000, seed)
    assert len(batches) > 20
    assert all(s == 0 for b in batches for s in b.staleness)


@pytest.mark.parametrize("eta", [1, 2, 3])
def test_random_runs_never_exceed_eta(eta):
    batches = drive(StalenessConfig(eta=eta, batch_size=8, group_size=2), 5000, eta)
    assert len(batches) > 30
    assert all(len(b.groups) == 8 for b in batches)
    assert max(s for b in batches for s in b.staleness) <= eta
    assert max(s for b in batches for s in b.staleness) >= 1  # staleness is actually used


# -- waiting, listeners, checkpoints, sketches ---------------------------------------------


def test_wait_ready_blocks_without_polling_and_wakes_on_occupy():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1))
    m.reserve(0, 0, 0)
    assert not m.wait_ready(timeout=0.01)
    woke = []
    m.add_ready_listener(woke.append)
    t = threading.Thread(target=lambda: (time.sleep(0.05), m.complete(0, 0)))
    t.start()
    assert m.wait_ready()  # blocks until the thread's Occupy
    t.join()
    assert woke == [0]


def test_export_restore_round_trip_and_corruption():
    cfg = StalenessConfig(eta=2, batch_size=2, group_size=2)
    m = StalenessManager(cfg)
    drive_state = [(0, 0, 0), (0, 1, 0), (1, 10, 0), (2, 20, 0)]
    for g, t, v in drive_state:
        m.reserve(g, t, v)
    m.complete(0, 0)
    m.complete(0, 1)
    state = m.export_state()
    m2 = StalenessManager.restore(state)
    assert m2.export_state() == state
    assert m2.view() == m.view()
    bad = {**state, "version": 9}
    with pytest.raises(CorruptState, match="outside"):
        StalenessManager.restore(bad)
    with pytest.raises(CorruptState, match="format"):
        StalenessManager.restore({**state, "format": 0})


def test_sketch_sees_its_own_reservations_and_never_touches_the_manager():
    m = StalenessManager(StalenessConfig(eta=0, batch_size=2))
    before = m.export_state()
    sk = m.sketch()
    sk.reserve(1, 1, 0)
    sk.reserve(2, 2, 0)
    assert not sk.verify(0)
    assert m.verify(0) and m.export_state() == before
    tentative = sk.sketch()
    assert not tentative.verify(0)
    assert sk.verify(0, group_id=1)  # a member of a group the sketch reserved


# -- fixes found by an independent randomized check (issue #15) ------------------------------


def test_round_trip_remembers_aborted_groups():
    """A straggler of a group aborted before the checkpoint is discarded after restore, and
    the aborted id takes no new Reserve (as before the round trip)."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2, group_size=2))
    m.reserve(4, 40, 0)
    m.reserve(4, 41, 0)
    m.abort(4)
    restored = StalenessManager.restore(m.export_state())
    for manager in (m, restored):
        out = manager.complete(4, 40)
        assert out.discarded and out.abort_trajectories == (40,)
        assert not manager.verify(0, group_id=4)
        with pytest.raises(StalenessViolation, match="was aborted"):
            manager.reserve(4, 42, 0)
    assert restored.export_state() == m.export_state()


def test_round_trip_keeps_arrival_order_within_a_version():
    """Which reservation is dropped first (the oldest of its version) and which occupied
    group moves first survive the round trip: the rings are saved in arrival order."""
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2, group_size=2), version=1)
    m.reserve(1, 10, 1)  # group 1 enters version 1 first ...
    m.reserve(2, 20, 0)  # ... group 2 enters version 0 ...
    m.reserve(1, 11, 0)  # ... then group 1 joins version 0 after group 2
    restored = StalenessManager.restore(m.export_state())
    assert restored.export_state() == m.export_state()
    assert restored.view() == m.view()


@pytest.mark.parametrize("bad", ["0", 1.0, None, True])
def test_verify_rejects_a_non_int_version_with_a_typed_error(bad):
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2))
    for check in (m.verify, m.sketch().verify):
        with pytest.raises(StalenessError, match="V_traj must be a non-negative int"):
            check(bad)


def test_verify_and_reserve_agree_on_a_negative_version():
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2))
    before = m.export_state()
    for call in (lambda: m.verify(-1), lambda: m.reserve(0, 0, -1), lambda: m.sketch().verify(-1)):
        with pytest.raises(StalenessError, match="V_traj must be a non-negative int"):
            call()
    assert m.export_state() == before


def test_discarded_completions_report_a_ready_buffer():
    # A straggler of an aborted group, while the trainer's buffer is Ready.
    m = StalenessManager(StalenessConfig(eta=1, batch_size=1))
    m.reserve(0, 0, 0)
    m.reserve(1, 1, 0)
    m.abort(1)
    assert m.complete(0, 0).ready
    out = m.complete(1, 1)
    assert out.discarded and out.ready
    assert m.abort(1).ready  # a second abort of the same group: discarded, still Ready
    # A surplus member finishing after its group was occupied (group redundancy).
    cfg = StalenessConfig(eta=1, batch_size=1, group_size=1, group_redundancy=1.0)
    m = StalenessManager(cfg)
    m.reserve(0, 0, 0)
    m.reserve(0, 1, 0)
    assert m.complete(0, 0).ready
    out = m.complete(0, 1)
    assert out.discarded and out.ready


@pytest.mark.parametrize("key", ["eta", "batch_size", "group_size"])
def test_config_refuses_a_bool_as_a_count(key):
    with pytest.raises(InvalidConfig, match=f"{key}=True is not an integer"):
        StalenessManager(StalenessConfig(**{key: True}))


@pytest.mark.parametrize(
    ("field", "value"),
    [("batch_size", 0), ("eta", -1), ("eta", 10**20), ("group_size", True)],
)
def test_a_saved_state_with_invalid_settings_is_corrupt_naming_the_field(field, value):
    # the settings were valid when saved: a value the protocol refuses means the state
    # was damaged or edited (CorruptState), not a configuration to fix (InvalidConfig)
    m = StalenessManager(StalenessConfig(eta=1, batch_size=2, group_size=2))
    state = m.export_state()
    bad = {**state, "config": {**state["config"], field: value}}
    with pytest.raises(CorruptState) as err:
        StalenessManager.restore(bad)
    assert not isinstance(err.value, InvalidConfig)
    message = str(err.value)
    assert f"field 'config': {field}={value!r}" in message
    assert "restore an earlier one" in message
    with pytest.raises(CorruptState, match=r"unknown keys \['extra'\] or lacks \['eta'\]"):
        config = {k: v for k, v in state["config"].items() if k != "eta"}
        StalenessManager.restore({**state, "config": {**config, "extra": 1}})


@pytest.mark.parametrize("eta", [10**20, 2**62, MAX_ETA + 1])
def test_an_eta_the_manager_cannot_hold_is_refused_by_the_config_itself(eta):
    # was OverflowError (10**20) and MemoryError (2**62) where the rings were allocated
    with pytest.raises(InvalidConfig, match=rf"eta={eta} is too large: use at most {MAX_ETA}"):
        StalenessConfig(eta=eta)
    StalenessManager(StalenessConfig(eta=MAX_ETA))  # the bound itself is usable


def test_more_trajectories_than_the_protocol_holds_are_refused_naming_the_keys():
    with pytest.raises(InvalidConfig, match=r"eta=1024, batch_size=1024, group_size=1 hold"):
        StalenessConfig(eta=1024, batch_size=1024)
