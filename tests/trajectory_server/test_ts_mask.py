"""The loss mask of multi-turn trajectories in the trajectory server: stored beside the
response, carried by every payload, the wire and checkpoints; all True by default."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trajectory_server.test_ts_persist import PositionedSource, positioned
from trajectory_server import (
    FinishedTrajectory,
    InvalidPayload,
    PartialTrajectory,
    TrajectoryServer,
    TrajectoryServerConfig,
    wire,
)
from trajectory_server.types import Completion


def turns(*segments: tuple[str, int, int]) -> tuple[np.ndarray, ...]:
    """A response made of segments ``("model", n, version)`` or ``("obs", n, _)``:
    observation tokens carry logprob 0.0 and the version of the model token before."""
    tokens, logprobs, versions, mask = [], [], [], []
    last = -1
    for kind, n, version in segments:
        model = kind == "model"
        last = version if model else last
        tokens += [(len(tokens) + i) % 50 + 3 for i in range(n)]
        logprobs += [-0.5 if model else 0.0] * n
        versions += [last] * n
        mask += [model] * n
    return (
        np.array(tokens, np.int32),
        np.array(logprobs, np.float32),
        np.array(versions, np.int32),
        np.array(mask, np.bool_),
    )


def server() -> TrajectoryServer:
    return TrajectoryServer(
        TrajectoryServerConfig(eta=1, batch_size=1, group_size=2), PositionedSource()
    )


def test_a_multi_turn_trajectory_keeps_its_mask_from_route_to_the_trainer():
    ts = server()
    ts.route([0, 1], 0, "a")
    first = turns(("model", 3, 0), ("obs", 2, 0))
    ts.report_progress([PartialTrajectory(0, *first)], "a")
    ts.interrupt_return([PartialTrajectory(0, *first)])
    (again,) = ts.route([0], None, "b")
    assert again.mask.dtype == np.bool_
    assert again.mask.tolist() == [True] * 3 + [False] * 2  # the instance continues after it
    whole = turns(("model", 3, 0), ("obs", 2, 0), ("model", 4, 1))
    ts.hand_to_reward([FinishedTrajectory(0, *whole[:3], "stop", whole[3])], "w")
    (task,) = ts.reassign_rewards("w", "w2")
    assert task.mask.tolist() == whole[3].tolist()
    ts.complete_many([Completion(0, *whole[:3], 1.0, "stop", {}, whole[3])], worker_id="w2")
    ts.complete(1, *turns(("model", 2, 0))[:3], reward=0.0, finish_reason="stop")  # no mask
    batch = ts.take_batch([0])
    by_id = {t.traj_id: t for t in batch.groups[0].trajectories}
    assert by_id[0].mask.tolist() == whole[3].tolist()
    assert by_id[1].mask.tolist() == [True, True]  # the default: every token the model's
    assert by_id[0].v_traj == 0  # the version of the first generated token, whatever follows


def test_every_message_carries_the_mask_over_the_wire():
    t, lp, v, m = turns(("model", 2, 0), ("obs", 3, 0), ("model", 1, 2))
    for msg, records in (
        (wire.InterruptReturn((PartialTrajectory(4, t, lp, v, m),)), "partials"),
        (wire.ProgressReport((PartialTrajectory(4, t, lp, v, m),), "a"), "partials"),
        (wire.HandToReward((FinishedTrajectory(4, t, lp, v, "stop", m),), "w"), "finished"),
        (wire.CompletionBatch((Completion(4, t, lp, v, 1.0, "stop", {}, m),)), "completions"),
    ):
        (record,) = getattr(wire.unpack(wire.pack(msg)), records)
        assert record.mask.dtype == np.bool_ and record.mask.tolist() == m.tolist()
    ts = server()
    ts.route([0], 0, "a")
    ts.complete(0, t, lp, v, reward=1.0, finish_reason="stop", mask=m)
    ts.route([1], 0, "a")
    ts.complete(1, t, lp, v, reward=0.0, finish_reason="stop")
    batch = wire.unpack(wire.pack(ts.take_batch([0])))
    masks = [x.mask.tolist() for x in batch.groups[0].trajectories]
    assert masks == [m.tolist(), [True] * len(t)]


@pytest.mark.parametrize(
    ("mask", "error"),
    [
        (np.array([1, 1, 2, 1, 1, 1]), "bool"),  # not a 0/1 mask
        (np.ones(5, np.bool_), "one entry per token"),
        (np.ones((6, 1), np.bool_), "1-D"),
        (np.array([1.0] * 6), "bool"),
    ],
)
def test_a_malformed_mask_is_refused_and_changes_nothing(mask, error):
    ts = server()
    ts.route([0], 0, "a")
    t, lp, v, _ = turns(("model", 6, 0))
    with pytest.raises(InvalidPayload, match=error):
        ts.interrupt_return([PartialTrajectory(0, t, lp, v, mask)])
    assert ts.ledger()[0].tokens == 0


def test_a_continuation_must_keep_the_stored_mask_as_its_prefix():
    ts = server()
    ts.route([0], 0, "a")
    first = turns(("model", 2, 0), ("obs", 2, 0))
    ts.report_progress([PartialTrajectory(0, *first)], "a")
    # the same tokens, but the observation now claims to be the model's
    relabelled = turns(("model", 4, 0), ("model", 1, 0))
    with pytest.raises(InvalidPayload, match="does not start with"):
        ts.interrupt_return([PartialTrajectory(0, *relabelled)])
    # integers 0/1 are a mask too
    more = turns(("model", 2, 0), ("obs", 2, 0), ("model", 1, 0))
    ts.interrupt_return([PartialTrajectory(0, *more[:3], more[3].astype(np.uint8))])
    assert ts.route([0], None, "a")[0].mask.tolist() == more[3].tolist()


def test_a_checkpoint_keeps_the_masks():
    ts = server()
    ts.route([0, 1, 2, 3], 0, "a")
    queued = turns(("model", 2, 0), ("obs", 3, 0))
    ts.interrupt_return([PartialTrajectory(0, *queued)])
    routed = turns(("model", 1, 0), ("obs", 1, 0), ("model", 1, 0))
    ts.report_progress([PartialTrajectory(1, *routed)], "a")
    done = turns(("model", 2, 0), ("obs", 1, 0), ("model", 2, 0))
    ts.complete(2, *done[:3], reward=1.0, finish_reason="stop", mask=done[3])
    state = wire.unpack_plain(wire.pack_plain(ts.export_state()))
    assert state["trajectories"]["mask"].dtype == np.bool_
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    again = {r.traj_id: r for r in restored.route([0, 1, 3], None, "b")}
    assert again[0].mask.tolist() == queued[3].tolist()
    assert again[1].mask.tolist() == routed[3].tolist()  # ROUTED: queued again, mask kept
    restored.complete(3, *turns(("model", 1, 0))[:3], reward=0.0, finish_reason="stop")
    batch = restored.take_batch([1])
    by_id = {t.traj_id: t.mask.tolist() for t in batch.groups[0].trajectories}
    assert by_id == {2: done[3].tolist(), 3: [True]}


def test_a_checkpoint_written_before_the_mask_loads_with_every_token_trained():
    ts = server()
    ts.route([0, 1], 0, "a")
    ts.interrupt_return([PartialTrajectory(0, *turns(("model", 3, 0))[:3])])
    ts.complete(1, *turns(("model", 2, 0))[:3], reward=1.0, finish_reason="stop")
    state = ts.export_state()
    del state["trajectories"]["mask"]  # what a checkpoint of an older StaleFlow holds
    state = wire.unpack_plain(wire.pack_plain(state))
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    (again,) = restored.route([0], None, "b")
    assert again.mask.dtype == np.bool_ and again.mask.tolist() == [True] * 3
    # and it continues like any response: the stored (all True) mask is the prefix
    restored.complete(0, *turns(("model", 5, 0))[:3], reward=0.0, finish_reason="stop")
    batch = restored.take_batch([0])
    assert [t.mask.tolist() for t in batch.groups[0].trajectories] == [[True] * 5, [True] * 2]
