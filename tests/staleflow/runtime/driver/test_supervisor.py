"""The supervisor's recovery decisions (docs/recovery.md, "Lost actors while running"),
one look (``tick``) at a time, over fakes of the run's pools, its control actor and a
clock (``tests/support/fake_pools.py``): no Ray, no process. The real restarts are
tested through launches (``tests/staleflow/recovery``)."""

from __future__ import annotations

import pytest

from staleflow.runtime.driver.supervised import ActorGone
from staleflow.runtime.errors import LaunchError
from tests.support.fake_pools import harness

pytestmark = pytest.mark.timeout(30)  # a fake clock that never moves must not hang CI

# -- rollout instances -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "reason",
    [
        "its actor died",
        # a hung instance: the control plane's snapshot timeout declares it lost (the
        # stall is the control plane's to notice); the supervisor restarts it the same way
        "no snapshot within recovery.snapshot_timeout_s=60",
    ],
)
def test_a_lost_instance_is_restarted_under_a_new_holder_and_joins_once_ready(reason):
    h = harness(instances=2)
    h.ledger.rewarding = {7: "reward/0.0"}  # a hand-off it made, maybe never delivered
    h.control.lose(0, "0.0", reason)
    h.supervisor.tick()
    assert h.rollout.killed == ["actor-0.0"]
    # a new incarnation in its slot, Pulling the PS's current version, told the workers
    assert h.rollout.spawned == [(0, 1, {"reward/0.0": "actor-reward/0.0"}, 3)]
    assert h.rollout.holder(0) == "0.1"
    assert ("reward/0.0", [7]) in h.rewards.sent  # sent again to its worker
    assert h.supervisor.live_instances() == [1] and 0 in h.supervisor.pending
    for _ in range(3):  # still building its engine: it does not join, and nothing waits
        h.supervisor.tick()
    assert h.control.joins == [] and len(h.rollout.spawned) == 1
    h.rollout.starting[0].resolve(3)
    h.supervisor.tick()
    assert h.control.joins == [(0, "actor-0.1", "0.1", 3, "instance_restarted")]
    assert h.supervisor.pending == {} and h.supervisor.live_instances() == [0, 1]
    assert h.live.writes[-1]["instance/0"] == "actor-0.1"
    h.supervisor.tick()
    assert len(h.control.joins) == 1  # joined once


def test_an_instance_that_dies_while_starting_is_started_again():
    h = harness(instances=2)
    h.control.lose(1, "1.0")
    h.supervisor.tick()
    h.rollout.starting[1].fail(ActorGone("The actor died unexpectedly before finishing"))
    h.supervisor.tick()
    assert [(i, k) for i, k, *_ in h.rollout.spawned] == [(1, 1), (1, 2)]
    assert h.rollout.killed == ["actor-1.0", "actor-1.1"] and h.control.joins == []
    h.rollout.starting[1].resolve(4)
    h.supervisor.tick()
    assert h.control.joins == [(1, "actor-1.2", "1.2", 4, "instance_restarted")]


def test_after_max_restarts_an_instance_is_given_up_and_the_run_goes_on_without_it():
    h = harness(instances=2, max_restarts=1)
    h.control.lose(0, "0.0")
    h.supervisor.tick()
    h.rollout.starting[0].resolve(3)
    h.supervisor.tick()
    h.control.lose(0, "0.1", "engine crashed")
    h.supervisor.tick()
    assert len(h.rollout.spawned) == 1  # no second restart
    assert h.rollout.killed == ["actor-0.0", "actor-0.1"]
    assert h.control.kinds() == ["instance_given_up"]
    assert "1 restarts used; last: engine crashed" in h.control.notes[0][2]
    assert h.supervisor.live_instances() == [1] and h.supervisor.removed == {0}
    h.supervisor.tick()  # the run goes on with instance 1
    h.supervisor.write_live()
    assert "instance/0" not in h.live.writes[-1] and "instance/1" in h.live.writes[-1]


def test_losing_every_instance_out_of_restarts_stops_the_run_naming_how_to_resume():
    h = harness(instances=1, max_restarts=0)
    h.control.lose(0, "0.0")
    with pytest.raises(LaunchError, match=r"max_restarts=0\).*--resume"):
        h.supervisor.tick()


# -- reward workers --------------------------------------------------------------------------


def test_a_lost_reward_worker_is_replaced_and_what_it_held_is_scored_elsewhere():
    h = harness(instances=2, workers=2)
    # 10, 11 on the worker that dies; 12 on the other; 13 on no worker (scored later)
    h.ledger.rewarding = {10: "reward/0.0", 11: "reward/0.0", 12: "reward/1.0", 13: None}
    h.rewards.dead.add("reward/0.0")
    h.supervisor.tick()  # its ping is sent
    h.supervisor.tick()  # and has failed
    assert h.rewards.removed == ["reward/0.0"]
    assert list(h.rewards.live()) == ["reward/1.0", "reward/0.1"]  # a new incarnation
    assert h.rewards.sent == [("reward/1.0", [10, 11])]  # to the first live worker
    assert h.ledger.rewarding == {12: "reward/1.0", 13: None}  # scored; the rest left alone
    for inst in (0, 1):  # every instance hands its finished responses to the new set
        assert h.rollout.told[inst] == h.rewards.live()
    assert len(h.control.replays) == 1  # the completions it stored but never reported
    assert h.control.kinds() == ["reward_worker_lost", "reward_worker_restarted"]
    assert h.control.notes[0][3] == {"reassigned": 2}
    assert h.live.writes[-1]["reward/0"] == "actor-reward/0.1"
    h.rewards.dead.clear()
    h.supervisor.tick()
    h.supervisor.tick()
    assert h.rewards.removed == ["reward/0.0"] and len(h.control.replays) == 1  # once


def test_a_hand_off_that_raced_with_the_reassignment_is_swept_every_two_seconds():
    h = harness(instances=1, workers=1)
    h.rewards.dead.add("reward/0.0")
    h.supervisor.tick()
    h.supervisor.tick()
    h.ledger.rewarding = {20: "reward/0.0"}  # stored by an instance after the sweep
    h.clock.advance(1.0)
    h.supervisor.tick()
    assert h.ledger.rewarding == {20: "reward/0.0"}  # not yet
    h.clock.advance(1.5)
    h.supervisor.tick()
    assert h.ledger.rewarding == {} and h.rewards.sent[-1] == ("reward/0.1", [20])


def test_a_replay_the_control_plane_failed_stops_the_run_naming_it():
    h = harness(instances=1, workers=1)
    h.control.replay_error = RuntimeError("the manager refused it")
    h.rewards.dead.add("reward/0.0")
    h.supervisor.tick()
    with pytest.raises(LaunchError, match="the control plane failed a replay"):
        h.supervisor.tick()  # the worker is replaced, and the failed replay named


def test_the_last_reward_worker_lost_out_of_restarts_stops_the_run():
    h = harness(instances=1, workers=1, max_restarts=0)
    h.rewards.dead.add("reward/0.0")
    h.supervisor.tick()
    with pytest.raises(LaunchError, match=r"every reward worker was lost.*--resume"):
        h.supervisor.tick()


def test_after_a_resume_what_was_being_scored_at_the_stop_goes_to_a_live_worker():
    h = harness(instances=1, workers=2)
    h.ledger.rewarding = {1: None, 2: None}
    assert h.supervisor.redispatch_rewards() == 2
    assert h.rewards.sent == [("reward/0.0", [1, 2])] and h.ledger.rewarding == {}


# -- PS replicas -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["actor", "worker"])
def test_a_lost_ps_replica_is_started_again_and_refilled_by_the_trainer(how):
    h = harness(replicas=2)
    (h.ps.dead if how == "actor" else h.ps.worker_dead).add("ps/1")
    h.supervisor.tick()
    h.supervisor.tick()
    assert h.ps.incarnation == {"ps/0": 0, "ps/1": 1} and h.trainer.refills == 1
    assert h.ps.killed == ["actor-ps/1#0"]
    # a live actor whose worker died frees the worker's memory first
    assert h.ps.stopped == ([] if how == "actor" else ["ps/1"])
    assert h.control.kinds() == ["ps_lost", "ps_restarted"]
    assert h.live.writes[-1]["ps/1"] == "actor-ps/1#1"
    assert any("ps restarted ps/1" in p for p in h.phases)
    h.supervisor.tick()
    h.supervisor.tick()
    assert h.trainer.refills == 1  # the new one answers


def test_a_ps_replica_lost_out_of_restarts_stops_the_run():
    h = harness(replicas=1, max_restarts=0)
    h.ps.dead.add("ps/0")
    h.supervisor.tick()
    h.supervisor.tick()  # the restart is refused off the loop ...
    with pytest.raises(LaunchError, match=r"PS replica ps/0 was lost.*max_restarts=0"):
        h.supervisor.tick()  # ... and stops the run at the next look


def test_at_the_end_of_training_a_dead_replica_is_restarted_and_a_silent_one_left():
    h = harness(replicas=2)
    h.ps.dead.add("ps/0")
    h.ps.hung.add("ps/1")
    h.supervisor.heal_ps(timeout_s=5)
    assert h.ps.incarnation == {"ps/0": 1, "ps/1": 0} and h.trainer.refills == 1


# -- stalls: the supervisor never waits on what may not answer --------------------------------


def test_a_busy_worker_or_replica_is_left_alone_however_long_its_ping_takes():
    h = harness(instances=1, workers=1, replicas=1)
    h.rewards.hung.add("reward/0.0")
    h.ps.hung.add("ps/0")
    for _ in range(20):
        h.clock.advance(30.0)
        h.supervisor.tick()
    assert h.rewards.removed == [] and h.ps.incarnation == {"ps/0": 0}
    assert h.control.notes == [] and h.rewards.pings == 1  # one ping, still pending


def test_a_join_the_control_loop_has_not_carried_out_does_not_hold_the_looks():
    h = harness(instances=2)
    h.control.join_done = False  # the loop waits, e.g. for a restarted PS
    h.control.lose(0, "0.0")
    h.supervisor.tick()
    h.rollout.starting[0].resolve(3)
    h.supervisor.tick()
    h.control.lose(1, "1.0")
    h.supervisor.tick()  # another look goes on: instance 1 restarts meanwhile
    assert [i for i, *_ in h.rollout.spawned] == [0, 1]
    h.control.join_calls[0].fail(RuntimeError("instance 0 refused the version"))
    with pytest.raises(LaunchError, match="the control plane failed instance/0 to join"):
        h.supervisor.tick()


# -- the end of the run, and stop ------------------------------------------------------------


def test_finish_settles_instances_rewards_and_replicas_without_restarting():
    h = harness(instances=3, workers=1, replicas=1)
    h.control.lose(2, "2.0")
    h.supervisor.tick()  # instance 2 is starting again
    h.control.lose(1, "1.0")  # lost after the control loop stopped
    h.rewards.dead.add("reward/0.0")
    h.ledger.rewarding = {5: "reward/0.0"}
    h.ps.dead.add("ps/0")
    h.clock.step = 1.0  # were something never scored, the wait would end
    h.supervisor.finish(timeout_s=60)
    assert len(h.rollout.spawned) == 1  # no restart at the end
    assert h.rollout.killed == ["actor-2.0", "actor-1.0", "actor-2.1"]
    assert h.supervisor.pending == {} and h.supervisor.live_instances() == [0]
    assert h.rewards.removed == ["reward/0.0"] and h.ledger.rewarding == {}
    assert h.rewards.sent == [("reward/0.1", [5])]
    assert h.ps.incarnation == {"ps/0": 1} and h.trainer.refills == 1
    assert set(h.live.writes[-1]) == {"instance/0", "reward/0", "ps/0", "trainer/0"}


def test_finish_gives_up_on_rewards_never_scored_after_its_timeout():
    h = harness(instances=1, workers=1)
    h.rewards.scores = False  # the worker takes them and never finishes
    h.ledger.rewarding = {5: "reward/0.0"}
    h.clock.step = 1.0
    h.supervisor.finish(timeout_s=10)
    assert h.ledger.rewarding == {5: "reward/0.0"}
    assert 1 < h.rewards.sent.count(("reward/0.0", [5])) <= 10  # sent again each round


def test_close_stops_what_is_starting_gives_back_the_slots_and_removes_live_json():
    h = harness(instances=2)
    h.control.lose(1, "1.0")
    h.supervisor.tick()
    h.supervisor.close()
    assert h.rollout.killed == ["actor-1.0", "actor-1.1"]
    assert h.rollout.released and h.live.removed


# -- elastic rollout -------------------------------------------------------------------------


def test_scaling_up_places_new_instances_that_join_once_ready():
    h = harness(instances=2)
    h.control.scale_to = 4
    h.supervisor.tick()
    assert h.rollout.slots() == {0, 1, 2, 3}
    assert [(i, k, v) for i, k, _, v in h.rollout.spawned] == [(2, 0, 3), (3, 0, 3)]
    h.rollout.starting[2].resolve(3)
    h.supervisor.tick()
    assert [(i, kind) for i, *_, kind in h.control.joins] == [(2, "instance_added")]
    # asked again: the one starting counts, nothing more is started
    assert h.supervisor.scale(4) == "removed 0 rollout instance(s)"
    assert len(h.rollout.spawned) == 2


def test_scaling_down_removes_the_highest_ids_and_keeps_one():
    h = harness(instances=3)
    h.control.scale_to = 1
    h.supervisor.tick()
    assert h.control.removed == [1, 2] and h.rollout.stopped == [1, 2]
    assert h.rollout.killed == ["actor-1.0", "actor-2.0"]
    assert h.supervisor.live_instances() == [0]
    assert h.supervisor.scale(0) == "removed 0 rollout instance(s)"  # one always stays
    assert h.supervisor.live_instances() == [0]
    # a later addition takes a freed slot, as a new incarnation there
    assert h.supervisor.scale(2) == "adding 1 rollout instance(s)"
    assert h.rollout.spawned[-1][:2] == (1, 1) and h.rollout.slots() == {0, 1, 2}


def test_an_instance_with_no_room_is_refused_as_an_event():
    h = harness(instances=1)
    h.rollout.room = False
    assert h.supervisor.scale(2).startswith("refused: no room")
    assert h.control.kinds() == ["scale_refused"] and h.rollout.spawned == []
