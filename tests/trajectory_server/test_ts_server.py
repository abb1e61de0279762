"""Unit tests of the trajectory server core: transitions, MLQ order, errors, capacity."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trajectory_server import (
    GroupGone,
    InvalidConfig,
    InvalidPayload,
    InvalidTransition,
    PartialTrajectory,
    TrajectoryGone,
    TrajectoryServer,
    TrajectoryServerConfig,
    TrajState,
    UnknownGroup,
    UnknownTrajectory,
    VersionConflict,
    wire,
)


def snapshot(ts: TrajectoryServer) -> tuple[object, ...]:
    return (tuple(ts.routing_view()), ts.stats())


def ids(ts: TrajectoryServer) -> list[int]:
    return [r.traj_id for r in ts.routing_view()]


def test_fills_to_capacity_with_groups_of_initial_trajectories(ts):
    s = ts.stats()
    assert (s.capacity_groups, s.groups, s.queued, s.initial) == (4, 4, 8, 8)
    view = ts.routing_view()
    assert [r.traj_id for r in view] == list(range(8))
    assert [r.group_id for r in view] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(r.v_traj is None and r.length == r.prompt_len for r in view)
    assert [r.prompt_len for r in view] == [2, 2, 3, 3, 4, 4, 2, 2]
    assert all(type(r.traj_id) is int and type(r.group_id) is int for r in view)
    assert ts.refill() == ()  # already full


def test_capacity_defaults_and_redundancy():
    cfg = TrajectoryServerConfig(eta=3, batch_size=8, group_size=16, group_redundancy=1 / 16)
    assert (cfg.capacity, cfg.trajectories_per_group) == (32, 17)
    assert TrajectoryServerConfig(eta=1, batch_size=8, batch_redundancy=0.25).capacity == 20
    assert TrajectoryServerConfig(eta=3, batch_size=8, capacity_groups=5).capacity == 5
    with pytest.raises(InvalidConfig, match="eta"):
        TrajectoryServerConfig(eta=-1)
    with pytest.raises(InvalidConfig, match="capacity_groups"):
        TrajectoryServerConfig(capacity_groups=0)


def test_route_sets_version_and_returns_payloads(ts):
    routed = ts.route([0, 1], 5, instance_id="inst-0")
    assert [p.traj_id for p in routed] == [0, 1]
    p = routed[0]
    assert (p.group_id, p.v_traj, p.sample_id, p.answer) == (0, 5, 0, "0")
    assert p.prompt.dtype == np.int32 and p.prompt.tolist() == [10, 11]
    assert p.tokens.dtype == np.int32 and len(p.tokens) == 0
    assert p.logprobs.dtype == np.float32 and p.versions.dtype == np.int32
    assert ts.state_of(0) is TrajState.ROUTED
    assert ids(ts) == [2, 3, 4, 5, 6, 7]
    s = ts.stats()
    assert (s.queued, s.routed, s.routed_by_v) == (6, 2, {5: 2})


def test_route_with_per_trajectory_versions(ts):
    routed = ts.route([3, 2], {3: 1, 2: 4}, "i")
    assert [(p.traj_id, p.v_traj) for p in routed] == [(3, 1), (2, 4)]


def test_mlq_order_smaller_version_first_initial_last_fifo_within(ts, response):
    ts.route([0, 1, 2, 3, 4], {0: 2, 1: 1, 2: 2, 3: 1, 4: 2}, "i")
    # return in the order 2, 1, 0, 4, 3: FIFO by return time within each level
    for tid in (2, 1, 0, 4, 3):
        v = {0: 2, 1: 1, 2: 2, 3: 1, 4: 2}[tid]
        ts.interrupt_return([PartialTrajectory(tid, *response(tid + 1, v))])
    view = ts.routing_view()
    assert [r.traj_id for r in view] == [1, 3, 2, 0, 4, 5, 6, 7]
    assert [r.v_traj for r in view] == [1, 1, 2, 2, 2, None, None, None]
    assert view[0].length == view[0].prompt_len + 2


def test_partial_keeps_its_version_and_grows(ts, response):
    ts.route([0], 3, "a")
    ts.interrupt_return([PartialTrajectory(0, *response(4, 3))])
    assert ts.routing_view()[0].v_traj == 3
    with pytest.raises(VersionConflict, match="V_traj=3"):
        ts.route([0], 4, "b")
    routed = ts.route([0], None, "b")  # None keeps it
    assert routed[0].v_traj == 3 and routed[0].tokens.tolist() == response(4, 3)[0].tolist()
    # the continuation on a newer instance: versions 3 then 4
    t1, l1, v1 = response(4, 3)
    t2, l2, v2 = response(3, 4, start=4)
    status = ts.complete(
        0, np.r_[t1, t2], np.r_[l1, l2], np.r_[v1, v2], reward=1.0, finish_reason="stop"
    )
    assert (status.group_id, status.completed, status.live) == (0, 1, 2)
    assert not status.all_completed
    assert ts.stats().completed_by_v == {3: 1}


def test_initial_route_needs_a_valid_version(ts):
    before = snapshot(ts)
    with pytest.raises(VersionConflict, match="needs a V_traj"):
        ts.route([0], None, "i")
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(VersionConflict, match="non-negative int"):
            ts.route([1], bad, "i")  # type: ignore[arg-type]
    with pytest.raises(VersionConflict, match="not given"):
        ts.route([0], {0: 1, 5: 1}, "i")
    assert snapshot(ts) == before


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda ts: ts.route([0, 0], 1, "i"), InvalidTransition, "more than once"),
        (lambda ts: ts.route([2, 99], 1, "i"), UnknownTrajectory, "never created"),
        (lambda ts: ts.route([1, 0], 1, "i"), InvalidTransition, "is ROUTED on instance 'x'"),
        (lambda ts: ts.complete(2, [], [], [], 1.0, "stop"), InvalidTransition, "is QUEUED"),
        (lambda ts: ts.complete(99, [], [], [], 1.0, "stop"), UnknownTrajectory, "never"),
        (lambda ts: ts.interrupt_return([PartialTrajectory(2, [], [], [])]), InvalidTransition, "ROUTED"),
        (lambda ts: ts.take_batch([0]), InvalidTransition, "no completed"),
        (lambda ts: ts.take_batch([42]), UnknownGroup, "never created"),
        (lambda ts: ts.abort_group(42), UnknownGroup, "never created"),
        (lambda ts: ts.abort([3, 99]), UnknownTrajectory, "never"),
    ],
)  # fmt: skip
def test_wrong_transitions_raise_and_change_nothing(ts, call, error, message):
    ts.route([0], 1, "x")
    before = snapshot(ts)
    with pytest.raises(error, match=message):
        call(ts)
    assert snapshot(ts) == before


def test_bad_payloads_are_rejected_without_side_effects(ts, response):
    ts.route([0, 1], 2, "i")
    t, lp, v = response(3, 2)
    before = snapshot(ts)
    cases = [
        ((t, lp[:2], v), "lengths 3, 2, 3"),
        ((t, lp, np.full(3, 1, np.int32)), "older than its V_traj=2"),
        ((t.astype(np.float64), lp, v), "integers"),
        ((-t, lp, v), "negative token"),
        ((t, np.full(3, np.nan, np.float32), v), "NaN"),
        ((t.reshape(3, 1), lp, v), "1-D"),
    ]
    for arrays, message in cases:
        with pytest.raises(InvalidPayload, match=message):
            ts.complete(0, *arrays, reward=1.0, finish_reason="stop")
        with pytest.raises(InvalidPayload, match=message):
            ts.interrupt_return(
                [PartialTrajectory(1, *response(1, 2)), PartialTrajectory(0, *arrays)]
            )
    with pytest.raises(InvalidPayload, match="not finite"):
        ts.complete(0, t, lp, v, reward=float("inf"), finish_reason="stop")
    with pytest.raises(InvalidPayload, match="info"):
        ts.complete(0, t, lp, v, reward=0.0, finish_reason="stop", info={"x": [1]})  # type: ignore[dict-item]
    assert snapshot(ts) == before


def test_response_must_extend_what_was_routed(ts, response):
    ts.route([0], 0, "i")
    ts.interrupt_return([PartialTrajectory(0, *response(5, 0))])
    ts.route([0], None, "i")
    with pytest.raises(InvalidPayload, match="does not start with the 5 tokens"):
        ts.complete(0, *response(2, 0, start=5), reward=1.0, finish_reason="stop")
    assert ts.state_of(0) is TrajState.ROUTED
    ts.complete(0, *response(7, 0), reward=1.0, finish_reason="stop")


def test_lists_from_python_are_converted(ts):
    ts.route([0], 1, "i")
    ts.complete(0, [5, 6], [-0.1, -0.2], [1, 2], reward=1, finish_reason="length")
    ts.complete_many([])  # nothing to do
    ts.route([1], 1, "i")
    ts.complete(1, [5], [-0.1], [1], reward=0.0, finish_reason="stop")
    batch = ts.take_batch([0])
    traj = batch.groups[0].trajectories[0]
    assert traj.tokens.dtype == np.int32 and traj.logprobs.dtype == np.float32
    assert traj.versions.tolist() == [1, 2] and traj.reward == 1.0 and type(traj.reward) is float


def complete_group(ts, gid, response, v=0):
    members = ts.group_members(gid)
    ts.route(members, v, "i")
    for n, tid in enumerate(members):
        ts.complete(tid, *response(n + 1, v), reward=float(n), finish_reason="stop", info={"n": n})
    return members


def test_take_batch_hands_payloads_over_and_refills(ts, response):
    complete_group(ts, 0, response, v=1)
    complete_group(ts, 2, response, v=0)
    batch = ts.take_batch([2, 0])
    assert [g.group_id for g in batch.groups] == [2, 0]
    g = batch.groups[1]
    assert (g.sample_id, g.answer, g.prompt.tolist()) == (0, "0", [10, 11])
    assert [t.traj_id for t in g.trajectories] == [0, 1]
    assert [len(t.tokens) for t in g.trajectories] == [1, 2]
    assert [t.reward for t in g.trajectories] == [0.0, 1.0]
    assert g.trajectories[1].info == {"n": 1} and g.trajectories[0].v_traj == 1
    assert batch.dropped == ()
    s = ts.stats()
    assert (s.groups, s.consumed_groups, s.consumed_trajectories, s.created_groups) == (4, 2, 4, 6)
    assert ids(ts)[-4:] == [8, 9, 10, 11]  # two new groups at the back
    with pytest.raises(TrajectoryGone, match="consumed or aborted"):
        ts.state_of(0)
    with pytest.raises(TrajectoryGone):
        ts.complete(1, *response(2, 1), reward=1.0, finish_reason="stop")
    with pytest.raises(UnknownGroup, match="already consumed"):
        ts.take_batch([0])


def test_take_batch_with_selection_drops_the_rest(make_ts, response):
    ts = make_ts(group_size=2, group_redundancy=1.0)  # 4 trajectories per group
    ts.route([0, 1, 2], 0, "inst")
    for tid in (0, 1):
        ts.complete(tid, *response(2, 0), reward=1.0, finish_reason="stop")
    with pytest.raises(InvalidTransition, match="ROUTED"):
        ts.take_batch([0], select={0: [0, 2]})
    with pytest.raises(InvalidTransition, match="belongs to group 1"):
        ts.take_batch([0], select={0: [0, 4]})
    with pytest.raises(InvalidTransition, match="not given"):
        ts.take_batch([0], select={1: [4]})
    batch = ts.take_batch([0], select={0: [1]})
    assert [t.traj_id for t in batch.groups[0].trajectories] == [1]
    dropped = {(d.traj_id, d.state, d.instance_id) for d in batch.dropped}
    assert dropped == {
        (0, TrajState.COMPLETED, None),
        (2, TrajState.ROUTED, "inst"),
        (3, TrajState.QUEUED, None),
    }
    s = ts.stats()
    assert (s.consumed_trajectories, s.aborted_trajectories, s.routed, s.completed) == (1, 3, 0, 0)


def test_read_batch_is_what_take_batch_hands_out_and_changes_nothing(make_ts, response):
    """A streaming trainer reads its buffer's groups before the Consume: the same
    payloads, the TS (and its checkpoint) untouched, the same errors for bad requests."""
    ts = make_ts(group_size=2, group_redundancy=1.0)
    ts.route([0, 1, 2], 0, "inst")
    for tid in (0, 1):
        ts.complete(tid, *response(tid + 2, 0), reward=float(tid), finish_reason="stop")
    state, stats = ts.export_state(), ts.stats()
    with pytest.raises(InvalidTransition, match="ROUTED"):
        ts.read_batch([0], select={0: [0, 2]})
    with pytest.raises(InvalidTransition, match="not given"):
        ts.read_batch([0], select={1: [4]})
    read = ts.read_batch([0], select={0: [1, 0]})
    assert read.dropped == ()
    assert ts.stats() == stats
    assert wire.pack_plain(ts.export_state()) == wire.pack_plain(state)
    taken = ts.take_batch([0], select={0: [1, 0]})
    (r,), (t,) = read.groups, taken.groups
    assert (r.group_id, r.sample_id, r.answer, r.prompt.tolist()) == (
        t.group_id,
        t.sample_id,
        t.answer,
        t.prompt.tolist(),
    )
    assert [x.traj_id for x in r.trajectories] == [x.traj_id for x in t.trajectories] == [1, 0]
    for a, b in zip(r.trajectories, t.trajectories, strict=True):
        assert (a.tokens.tolist(), a.logprobs.tolist(), a.reward) == (
            b.tokens.tolist(),
            b.logprobs.tolist(),
            b.reward,
        )
    assert read.temperature == taken.temperature
    with pytest.raises(UnknownGroup, match="already consumed"):
        ts.read_batch([0])


def test_take_batch_forgets_the_groups_read_before_without_handing_them_again(ts, response):
    """A streamed group crosses the wire once: ``read=`` names groups the trainer read
    already, which leave the TS like the rest but come back without their payloads."""
    complete_group(ts, 0, response)
    complete_group(ts, 1, response)
    ts.route(ts.group_members(2), 0, "inst")
    ts.complete(4, *response(1, 0), reward=1.0, finish_reason="stop")
    ts.read_batch([0])
    batch = ts.take_batch([0, 1, 2], read=[0])
    assert [g.group_id for g in batch.groups] == [1, 2]
    assert [(d.traj_id, d.state) for d in batch.dropped] == [(5, TrajState.ROUTED)]
    s = ts.stats()
    assert (s.consumed_groups, s.consumed_trajectories, s.aborted_trajectories) == (3, 5, 1)
    with pytest.raises(UnknownGroup, match="already consumed"):
        ts.take_batch([0])


def test_take_batch_refuses_read_groups_it_was_not_given_and_changes_nothing(ts, response):
    complete_group(ts, 0, response)
    complete_group(ts, 1, response)
    state = wire.pack_plain(ts.export_state())
    with pytest.raises(InvalidTransition, match=r"read names groups \[1\] not given"):
        ts.take_batch([0], read=[0, 1])
    assert wire.pack_plain(ts.export_state()) == state
    assert [g.group_id for g in ts.take_batch([0, 1], read=[1]).groups] == [0]


def test_abort_in_any_state_and_group_removal(ts, response):
    ts.route([0, 2], 1, "i")
    ts.complete(2, *response(1, 1), reward=0.0, finish_reason="stop")
    aborted = ts.abort([0, 1, 2])
    assert [(a.traj_id, a.state, a.instance_id) for a in aborted] == [
        (0, TrajState.ROUTED, "i"),
        (1, TrajState.QUEUED, None),
        (2, TrajState.COMPLETED, None),
    ]
    s = ts.stats()
    # group 0 emptied and was replaced by group 4; group 1 still has trajectory 3
    assert (s.groups, s.aborted_groups, s.aborted_trajectories, s.completed) == (4, 1, 3, 0)
    assert ts.group_members(1) == (3,)
    assert ts.group_status(1).live == 1
    with pytest.raises(TrajectoryGone):
        ts.abort([0])
    assert [a.traj_id for a in ts.abort_group(1)] == [3]
    assert ts.stats().created_groups == 6


def test_filter_group_drops_a_completed_group_counted_apart_and_refills(ts, response):
    """Dynamic sampling's drop: the audit must tell it from an abort, and the ledger gives
    the graded rewards it decided on (none for a reward function that failed)."""
    ts.route([0, 1], 0, "i")
    ts.complete(0, *response(2, 0), reward=1.0, finish_reason="stop")
    ts.complete(1, *response(2, 0), reward=0.0, finish_reason="stop", info={"reward_error": "x"})
    rewards = {e.traj_id: e.reward for e in ts.ledger() if e.group_id == 0}
    assert rewards == {0: 1.0, 1: None}
    assert {e.reward for e in ts.ledger() if e.group_id != 0} == {None}  # not completed
    out = ts.filter_group(0)
    assert [(a.traj_id, a.state) for a in out] == [
        (0, TrajState.COMPLETED),
        (1, TrajState.COMPLETED),
    ]
    s = ts.stats()
    assert (s.filtered_groups, s.filtered_trajectories) == (1, 2)
    assert (s.aborted_groups, s.aborted_trajectories, s.consumed_trajectories) == (0, 0, 0)
    assert s.groups == 4 and s.created_groups == 5  # its slot refilled at once
    assert s.created_trajectories == s.queued + s.filtered_trajectories
    assert s.metrics()["ts/filtered_groups"] == 1.0
    with pytest.raises(GroupGone):
        ts.filter_group(0)


def test_exhausted_source_stops_refilling(make_ts, response):
    ts = make_ts(limit=5)
    assert ts.stats().groups == 4
    complete_group(ts, 0, response)
    complete_group(ts, 1, response)
    ts.take_batch([0, 1])
    s = ts.stats()
    assert (s.groups, s.dataset_exhausted, s.created_groups) == (3, True, 5)
    assert ts.refill() == ()


def test_no_auto_refill_until_asked(make_ts):
    ts = make_ts(auto_refill=False)
    ts.abort_group(0)
    assert ts.stats().groups == 3
    assert ts.refill() == (4,)
    assert make_ts(capacity_groups=1).stats().queued == 2


def test_bad_prompt_from_source_is_reported():
    class Broken:
        def next_sample(self):
            return dataclasses.make_dataclass("S", ["sample_id", "prompt_ids", "answer"])(
                7, np.array([], dtype=np.int32), "x"
            )

    with pytest.raises(InvalidPayload, match="sample 7"):
        TrajectoryServer(TrajectoryServerConfig(), Broken())


def test_routing_view_is_cached_until_a_change(ts, response):
    first = ts.routing_view()
    assert ts.routing_view() is first
    ts.route([0], 0, "i")
    second = ts.routing_view()
    assert second is not first and len(second) == 7
    ts.interrupt_return([PartialTrajectory(0, *response(1, 0))])
    assert [r.traj_id for r in ts.routing_view()] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_routing_view_of_2048_follows_one_change_per_cycle(make_ts, response):
    """What a coordinator cycle sees (its cost is measured by
    experiments/bench_trajectory_server.py, row routing_view)."""
    ts = make_ts(eta=3, batch_size=32, group_size=16)  # 128 groups x 16
    assert len(ts.routing_view()) == 2048
    ts.route(range(0, 2048, 2), 0, "i")
    ts.interrupt_return(PartialTrajectory(t, *response(3, 0)) for t in range(0, 1024, 2))
    for n in range(100):
        ts.route([1 + 2 * n], 1, "i")  # one change per cycle, as the coordinator does
        view = ts.routing_view()
        ids = {r.traj_id for r in view}
        assert len(view) == 1024 + 512 - n - 1 and 1 + 2 * n not in ids
    partial = {r.traj_id: r.v_traj for r in view if r.traj_id % 2 == 0}
    assert len(partial) == 512 and set(partial.values()) == {0}  # kept their V_traj


def test_stats_metrics_are_flat(ts):
    ts.route([0], 2, "i")
    m = ts.stats().metrics()
    assert m["ts/routed"] == 1.0 and m["ts/routed_by_v/2"] == 1.0 and m["ts/queued"] == 7.0


def test_caller_buffers_cannot_change_stored_responses(ts, response):
    ts.route([0, 1], 0, "i")
    tokens, logprobs, versions = response(3, 0)
    ts.interrupt_return([PartialTrajectory(0, tokens, logprobs, versions)])
    tokens[:] = 99  # an engine reusing its buffer
    routed = ts.route([0], None, "i")[0]
    assert routed.tokens.tolist() == response(3, 0)[0].tolist()
    assert not routed.tokens.flags.writeable and not routed.prompt.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        routed.prompt[0] = 1


def test_instance_id_must_be_int_or_str(ts):
    with pytest.raises(InvalidPayload, match="instance_id"):
        ts.route([0], 0, ("a", 1))  # type: ignore[arg-type]
    assert ts.state_of(0) is TrajState.QUEUED


def test_route_can_skip_trajectories_no_longer_queued(ts):
    ts.route([0], 0, "a")
    ts.abort([3])
    with pytest.raises(InvalidTransition):
        ts.route([0, 1], 0, "b")
    routed = ts.route([0, 1, 2, 3], {1: 0, 2: 1}, "b", skip_unavailable=True)
    assert [r.traj_id for r in routed] == [1, 2]
    assert ts.state_of(0) is TrajState.ROUTED and ts.state_of(1) is TrajState.ROUTED
