"""Round trips of the wire messages, and what the decoder refuses."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trajectory_server import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    PartialTrajectory,
    RewardTask,
    RoutableTrajectory,
    RoutedTrajectory,
    TrainingBatch,
    TrainingGroup,
    TrainingTrajectory,
    TrajState,
    WireError,
    wire,
)


def arrays(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 150_000, n, dtype=np.int32),
        rng.standard_normal(n).astype(np.float32),
        rng.integers(0, 9, n, dtype=np.int32),
    )


def same_arrays(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_route_request_and_reply_round_trip():
    req = wire.RouteRequest((4, 5), None, {4: 2, 5: 3}, "inst-1")
    assert wire.unpack(wire.pack(req)) == req
    t, lp, v = arrays(7)
    routed = RoutedTrajectory(4, 1, 2, 11, "42", np.arange(5, dtype=np.int32), t, lp, v)
    out = wire.unpack(wire.pack(wire.RouteReply((routed,))), wire.RouteReply).trajectories[0]
    assert (out.traj_id, out.group_id, out.v_traj, out.sample_id, out.answer) == (4, 1, 2, 11, "42")
    for name in ("prompt", "tokens", "logprobs", "versions"):
        assert same_arrays(getattr(out, name), getattr(routed, name)), name
    assert type(out.traj_id) is int


def test_training_batch_round_trip_with_nested_records_and_enums():
    t, lp, v = arrays(3)
    traj = TrainingTrajectory(9, 1, t, lp, v, 1.0, "stop", {"len": 3, "tag": "x", "p": 0.5})
    group = TrainingGroup(2, 7, "1", np.array([1, 2], np.int32), (traj, traj))
    dropped = (
        AbortedTrajectory(10, 2, TrajState.ROUTED, 3),
        AbortedTrajectory(11, 2, TrajState.QUEUED, None),
    )
    batch = TrainingBatch((group,), dropped)
    out = wire.unpack(wire.pack(batch), TrainingBatch)
    assert out.dropped == dropped and out.dropped[0].state is TrajState.ROUTED
    g = out.groups[0]
    assert (g.group_id, g.sample_id, g.answer, len(g.trajectories)) == (2, 7, "1", 2)
    o = g.trajectories[1]
    assert (o.traj_id, o.v_traj, o.reward, o.finish_reason) == (9, 1, 1.0, "stop")
    assert o.info == traj.info
    assert same_arrays(o.tokens, t) and same_arrays(o.logprobs, lp) and same_arrays(o.versions, v)


def test_completion_partial_and_status_batches_round_trip():
    c = Completion(3, *arrays(4), reward=0.0, finish_reason="length", info={})
    out = wire.unpack(wire.pack(wire.CompletionBatch((c, c))), wire.CompletionBatch).completions
    assert len(out) == 2 and out[0].finish_reason == "length"
    assert same_arrays(out[1].tokens, c.tokens)
    p = PartialTrajectory(8, *arrays(0))
    back = wire.unpack(wire.pack(wire.InterruptReturn((p,)))).partials[0]
    assert back.tokens.dtype == np.int32 and back.tokens.shape == (0,)
    statuses = wire.GroupStatusBatch((GroupStatus(1, 2, 3),))
    assert wire.unpack(wire.pack(statuses)) == statuses


def test_recovery_messages_round_trip():
    p = PartialTrajectory(8, *arrays(5))
    report = wire.unpack(wire.pack(wire.ProgressReport((p,), "inst-1")), wire.ProgressReport)
    assert report.instance_id == "inst-1" and same_arrays(report.partials[0].tokens, p.tokens)
    back = wire.unpack(wire.pack(wire.InterruptReturn((p,), 3)), wire.InterruptReturn)
    assert back.instance_id == 3
    f = FinishedTrajectory(4, *arrays(3), "length")
    hand = wire.unpack(wire.pack(wire.HandToReward((f,), "w0", 2)), wire.HandToReward)
    assert (hand.worker_id, hand.instance_id, hand.finished[0].finish_reason) == ("w0", 2, "length")
    task = RewardTask(4, 1, 0, 9, "42", np.arange(3, dtype=np.int32), *arrays(3), "stop")
    (out,) = wire.unpack(wire.pack(wire.RewardTaskBatch((task,))), wire.RewardTaskBatch).tasks
    assert (out.traj_id, out.group_id, out.v_traj, out.sample_id, out.answer) == (4, 1, 0, 9, "42")
    assert same_arrays(out.prompt, task.prompt) and same_arrays(out.versions, task.versions)


def test_plain_states_pack_arrays_as_bytes_and_refuse_objects():
    t, lp, _ = arrays(1000)
    tree = {"a": [1, "x", None, 2.5, True], "arrays": {"t": t, "lp": lp}, "n": {"k": [t[:3]]}}
    back = wire.unpack_plain(wire.pack_plain(tree))
    assert back["a"] == [1, "x", None, 2.5, True]
    assert same_arrays(back["arrays"]["t"], t) and not back["arrays"]["t"].flags.writeable
    assert len(wire.pack_plain({"t": t})) < t.nbytes + 64  # raw bytes, not a list of ints
    with pytest.raises(WireError, match="cannot pack"):
        wire.pack_plain({"x": object()})
    with pytest.raises(WireError, match="not a packed state"):
        wire.unpack_plain(b"\xc1")


def test_routing_columns_round_trip():
    records = (RoutableTrajectory(1, 0, 3, 10, 4), RoutableTrajectory(2, 0, None, 4, 4))
    cols = wire.unpack(wire.pack(wire.RoutingColumns.from_records(records)), wire.RoutingColumns)
    back = cols.to_records()
    assert back == records and type(back[0].traj_id) is int
    assert wire.RoutingColumns.from_records(()).to_records() == ()


def test_arrays_travel_as_raw_bytes_not_lists():
    t, lp, v = arrays(10_000)
    partial = PartialTrajectory(1, t, lp, v)
    packed = wire.pack(wire.InterruptReturn((partial,)))
    raw = t.nbytes + lp.nbytes + v.nbytes + partial.mask.nbytes  # the mask: 1 byte a token
    assert raw <= len(packed) < raw + 200
    assert t.tobytes() in packed  # the bytes themselves, little-endian
    decoded = wire.unpack(packed).partials[0].tokens
    assert not decoded.flags.writeable  # a view of the received buffer


@settings(max_examples=40, deadline=None)
@given(
    arr=hnp.arrays(
        dtype=st.sampled_from([np.int32, np.float32, np.int64, np.uint8, np.bool_, ">i4", ">f8"]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    )
)
def test_any_numeric_array_round_trips(arr):
    req = TrainingGroup(1, 1, "a", arr, ())
    out = wire.unpack(wire.pack(req), TrainingGroup).prompt
    assert out.shape == arr.shape
    assert out.dtype == arr.dtype.newbyteorder("<")
    assert np.array_equal(out, arr, equal_nan=arr.dtype.kind == "f")


def test_decoder_refuses_bad_input():
    with pytest.raises(WireError, match="not a wire message"):
        wire.unpack(b"\xc1garbage")
    with pytest.raises(WireError, match="unknown message tag 'nope'"):
        wire.unpack(msgpack.packb(["nope", []]))
    with pytest.raises(WireError, match="expected a RouteReply"):
        wire.unpack(wire.pack(wire.GroupStatusBatch(())), wire.RouteReply)
    with pytest.raises(WireError, match="needs 5 fields"):
        wire.unpack(msgpack.packb(["route_request", [1, 2]]))
    # an int32 array header that claims 5 elements, followed by only 8 bytes
    short = msgpack.ExtType(1, b"\x03<i4\x01" + (5).to_bytes(8, "little") + bytes(8))
    header_only = msgpack.packb(["interrupt_return", [[[1, short, b"", b""]]]])
    with pytest.raises(WireError, match="needs 20 bytes, got 8"):
        wire.unpack(header_only)
    with pytest.raises(WireError, match="cannot travel"):
        wire.pack(TrainingGroup(1, 1, "a", np.array(["x"], dtype=object), ()))
    with pytest.raises(WireError, match="not a wire message"):
        wire.pack(GroupStatus(1, 1, 1))
