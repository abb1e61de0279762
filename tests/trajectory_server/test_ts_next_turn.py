"""A multi-turn trajectory between its turns: after a model turn it is with a worker
(REWARDING) while its environment steps; ``next_turn`` appends the observation (mask
False), stores the environment's state and queues it for its next turn with its V_traj.
The state survives the wire, a lost worker and a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trajectory_server.test_ts_mask import server, turns
from tests.trajectory_server.test_ts_persist import positioned
from trajectory_server import (
    Completion,
    FinishedTrajectory,
    InvalidPayload,
    NextTurn,
    NotHolder,
    TrajectoryServer,
    TrajState,
    wire,
)


def _first_turn_with_worker(ts: TrajectoryServer) -> tuple[np.ndarray, ...]:
    ts.route([0, 1], 2, "a")
    turn = turns(("model", 3, 2))
    ts.hand_to_reward([FinishedTrajectory(0, *turn[:3], "stop", turn[3])], "w", instance_id="a")
    return turn


def test_next_turn_queues_the_trajectory_with_its_observation_and_state() -> None:
    ts = server()
    _first_turn_with_worker(ts)
    assert ts.env_states([0, 1]) == {0: b"", 1: b""}
    after = turns(("model", 3, 2), ("obs", 2, 2))
    ts.next_turn([NextTurn(0, *after, env_state=b"\x81\xa1k\x01")], worker_id="w")
    assert ts.state_of(0) is TrajState.QUEUED
    assert ts.env_states([0]) == {0: b"\x81\xa1k\x01"}
    view = {r.traj_id: r for r in ts.routing_view()}
    assert view[0].v_traj == 2  # kept: the bound covers every turn
    # the next turn may go only where the version is >= V_traj, and starts after the
    # observation
    (again,) = ts.route([0], None, "b")
    assert again.mask.tolist() == [True] * 3 + [False] * 2


def test_tool_waits_lists_a_trajectory_with_the_instance_its_turn_ended_on() -> None:
    ts = server()
    assert ts.tool_waits() == ()
    _first_turn_with_worker(ts)
    ((record, inst),) = ts.tool_waits()
    assert inst == "a" and record.traj_id == 0 and record.v_traj == 2
    assert record.length == record.prompt_len + 3  # the response at the turn's end
    after = turns(("model", 3, 2), ("obs", 2, 2))
    ts.next_turn([NextTurn(0, *after, env_state=b"")], worker_id="w")
    assert ts.tool_waits() == ()  # back in the queue: no longer waiting
    # a hand-off without an instance (a replayed completion) is not listed
    ts.route([0], None, "b")
    again = turns(("model", 3, 2), ("obs", 2, 2), ("model", 1, 2))
    ts.hand_to_reward([FinishedTrajectory(0, *again[:3], "stop", again[3])], "w")
    assert ts.tool_waits() == ()


def test_next_turn_refuses_a_late_or_wrong_message_and_changes_nothing() -> None:
    ts = server()
    turn = _first_turn_with_worker(ts)
    with pytest.raises(NotHolder):
        ts.next_turn([NextTurn(0, *turns(("model", 3, 2), ("obs", 1, 2)), b"")], worker_id="x")
    # appending model tokens here would train tokens no instance generated
    with pytest.raises(InvalidPayload, match="observation tokens only"):
        ts.next_turn([NextTurn(0, *turns(("model", 4, 2)), b"")], worker_id="w")
    with pytest.raises(InvalidPayload, match="does not start with"):  # another version
        ts.next_turn([NextTurn(0, *turns(("model", 3, 5), ("obs", 1, 5)), b"")], worker_id="w")
    assert ts.state_of(0) is TrajState.REWARDING and ts.env_states([0]) == {0: b""}
    # the worker was lost: the task another worker gets carries the state the TS has
    (task,) = ts.reassign_rewards("w", "w2")
    assert task.env_state == b"" and task.tokens.tolist() == turn[0].tolist()


def test_the_state_survives_the_wire_a_reassignment_and_a_checkpoint() -> None:
    ts = server()
    _first_turn_with_worker(ts)
    after = turns(("model", 3, 2), ("obs", 2, 2))
    msg = wire.unpack(
        wire.pack(wire.NextTurnBatch((NextTurn(0, *after, env_state=b"s1"),), "w")),
        wire.NextTurnBatch,
    )
    ts.next_turn(msg.turns, worker_id=msg.worker_id)
    ts.route([0], None, "b")
    second = turns(("model", 3, 2), ("obs", 2, 2), ("model", 2, 3))
    ts.hand_to_reward([FinishedTrajectory(0, *second[:3], "stop", second[3])], "w")
    (task,) = ts.reassign_rewards("w", "w2")
    assert task.env_state == b"s1"
    state = wire.unpack_plain(wire.pack_plain(ts.export_state()))
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    assert restored.env_states([0]) == {0: b"s1"}
    (task,) = restored.reassign_rewards(None, "w3")
    assert task.env_state == b"s1" and task.mask.tolist() == second[3].tolist()


def test_a_state_written_before_env_states_loads_with_none() -> None:
    ts = server()
    _first_turn_with_worker(ts)
    state = ts.export_state()
    del state["trajectories"]["env_state"]
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    assert restored.env_states([0, 1]) == {0: b"", 1: b""}


def test_a_resent_step_of_an_earlier_turn_is_a_late_message() -> None:
    ts = server()
    _first_turn_with_worker(ts)
    first = NextTurn(0, *turns(("model", 3, 2), ("obs", 2, 2)), env_state=b"s1")
    ts.next_turn([first], worker_id="w")
    ts.route([0], None, "a")
    second = turns(("model", 3, 2), ("obs", 2, 2), ("model", 2, 2))
    ts.hand_to_reward([FinishedTrajectory(0, *second[:3], "stop", second[3])], "w")
    # the same worker is sent the first turn again (a resend after an instance loss)
    stale = NextTurn(0, *turns(("model", 3, 2), ("obs", 1, 2)), env_state=b"s0")
    with pytest.raises(NotHolder, match="not this turn"):
        ts.next_turn([stale], worker_id="w")
    assert ts.env_states([0]) == {0: b"s1"} and ts.state_of(0) is TrajState.REWARDING


def test_a_resent_step_that_ends_the_episode_on_an_earlier_turn_is_a_late_completion() -> None:
    """The worker is sent the first turn again (after an instance loss) while the
    trajectory is with it on its second: this time that step ends the episode. Its
    completion is late, as a stale ``next_turn`` is (``NotHolder``, which the workers
    drop), not a malformed payload; the current turn's completion still goes through."""
    ts = server()
    _first_turn_with_worker(ts)
    ts.next_turn([NextTurn(0, *turns(("model", 3, 2), ("obs", 2, 2)), b"s1")], worker_id="w")
    ts.route([0], None, "a")
    second = turns(("model", 3, 2), ("obs", 2, 2), ("model", 2, 2))
    ts.hand_to_reward([FinishedTrajectory(0, *second[:3], "stop", second[3])], "w")
    stale = turns(("model", 3, 2))  # the first turn's response, as that step scores it
    with pytest.raises(NotHolder, match="earlier turn"):
        ts.complete_many([Completion(0, *stale[:3], 1.0, "stop", {}, stale[3])], worker_id="w")
    assert ts.state_of(0) is TrajState.REWARDING and ts.env_states([0]) == {0: b"s1"}
    # a completion that is no earlier turn of the stored response stays malformed
    other = turns(("model", 1, 2))
    other[0][0] += 1
    with pytest.raises(InvalidPayload):
        ts.complete_many([Completion(0, *other[:3], 1.0, "stop", {}, other[3])], worker_id="w")
    (status,) = ts.complete_many(
        [Completion(0, *second[:3], 1.0, "stop", {}, second[3])], worker_id="w"
    )
    assert ts.state_of(0) is TrajState.COMPLETED and status.completed == 1
