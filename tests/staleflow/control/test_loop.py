"""The control loop on its own: Occupy with redundancy, late messages, drops, released
Reserves, and errors that must stay loud. Driven directly on a small simulated cluster
(its loop, TS and manager are the real ones; nothing is faked)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from coordinator import Abort, CoordinatorConfig, Route
from staleflow.control import Consumed, Decision, Dropped, Issued, Occupied
from staleflow.control.late import complete_live
from staleflow.sim import SimCluster
from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.workload import WorkloadConfig
from trajectory_server.errors import UnknownGroup, UnknownTrajectory
from trajectory_server.types import Completion


def _cluster(**changes) -> tuple[SimCluster, list[Decision]]:
    config = ClusterConfig(
        instances=2,
        eta=0,
        batch_size=1,
        group_size=2,
        coordinator=CoordinatorConfig(period_s=1.0),
        workload=WorkloadConfig(max_response=200, prompt_median=20, max_prompt=50),
    ).with_(**changes)
    cluster = SimCluster(config)
    decisions: list[Decision] = []
    cluster.loop.on_decision = decisions.append
    return cluster, decisions


def _completion(tid: int) -> Completion:
    one = np.ones(2, np.int32)
    return Completion(tid, one, np.zeros(2, np.float32), np.zeros(2, np.int32), 1.0, "stop", {})


class _Done:
    def __init__(self, group_id: int, traj_id: int) -> None:
        self.group_id, self.traj_id = group_id, traj_id


def _start(cluster: SimCluster, group: int, trajs: list[int]) -> None:
    """Reserve and route ``trajs`` as a Route would (on instance 0, at version 0)."""
    for t in trajs:
        cluster.manager.reserve(group, t, 0)
    cluster.ts.route(trajs, 0, 0)


def _reward(cluster: SimCluster, group: int, trajs: list[int]) -> list[int]:
    """The reward path: store in the TS (late ones dropped), then Occupy."""
    stored = [c.traj_id for c in complete_live(cluster.ts, [_completion(t) for t in trajs])]
    cluster.loop.occupy([_Done(group, t) for t in stored])
    return stored


def test_group_redundancy_drops_the_surplus_and_its_late_reward() -> None:
    cluster, decisions = _cluster(group_redundancy=0.5)  # 3 members, 2 needed
    _start(cluster, 0, [0, 1, 2])
    assert _reward(cluster, 0, [0, 1]) == [0, 1]
    occupied = [d for d in decisions if isinstance(d, Occupied)]
    assert occupied[-1].outcome.occupied and occupied[-1].outcome.abort_trajectories == (2,)
    assert decisions[-1] == Dropped(0.0, (2,), ())
    assert cluster.ts.stats().aborted_trajectories == 1
    # trajectory 2 finishes after all: its reward is a late message, not an error
    assert _reward(cluster, 0, [2]) == []
    batch = cluster.loop.consume()
    assert batch is not None and batch.groups[0].trajectories == (0, 1)


def test_a_late_report_for_a_consumed_group_is_dropped() -> None:
    """The reward stage stored member 2 before the group was Occupied, but its report
    reaches the loop only after the group was consumed."""
    cluster, decisions = _cluster(group_redundancy=0.5)
    _start(cluster, 0, [0, 1, 2])
    complete_live(cluster.ts, [_completion(2)])  # stored; its report is still on the way
    assert _reward(cluster, 0, [0, 1]) == [0, 1]  # occupies; surplus 2 dropped from the TS
    assert isinstance(cluster.loop.consume(), object) and isinstance(decisions[-1], Consumed)
    cluster.loop.occupy([_Done(0, 2)])  # the late report
    late = decisions[-2]
    assert isinstance(late, Occupied) and late.outcome.discarded
    assert decisions[-1] == Dropped(0.0, (2,), ())


def test_batch_redundancy_drops_groups_that_no_longer_fit() -> None:
    cluster, decisions = _cluster(batch_size=2, batch_redundancy=0.5)  # 3 entries, 2 needed
    for g in (0, 1, 2):
        _start(cluster, g, [2 * g, 2 * g + 1])
    _reward(cluster, 0, [0, 1])
    _reward(cluster, 1, [2, 3])
    # eta = 0: buffer 0 is full, so group 2 can no longer make any buffer
    occupied = [d for d in decisions if isinstance(d, Occupied)]
    assert occupied[-1].outcome.abort_groups == (2,)
    assert decisions[-1] == Dropped(0.0, (), (2,))
    assert cluster.ts.stats().aborted_groups == 1
    assert _reward(cluster, 2, [4, 5]) == []  # its members finish late: dropped
    batch = cluster.loop.consume()
    assert batch is not None and [g.group_id for g in batch.groups] == [0, 1]


def test_dropped_trajectories_are_aborted_on_their_instance_at_the_next_cycle() -> None:
    cluster, decisions = _cluster(group_redundancy=0.5)
    assert cluster.loop.cycle()  # routes the first groups onto the instances
    first = next(c for c in decisions[-1].commands if isinstance(c, Route))  # type: ignore[union-attr]
    surplus = first.trajs[0]
    cluster.loop._drop((surplus,), ())  # as an Occupy with surplus does
    assert surplus not in {t.traj_id for t in cluster.ts.routing_view()}
    assert surplus in cluster.instances[first.inst].holds()
    assert cluster.check() == []  # dropped from the TS, on its way out of the instance
    assert not cluster.loop.cycle()  # not due yet
    cluster.now += cluster.config.coordinator.period_s
    assert cluster.loop.cycle()
    issued = decisions[-1]
    assert isinstance(issued, Issued)
    assert Abort(first.inst, (surplus,)) in issued.commands
    assert surplus not in cluster.instances[first.inst].holds()
    assert cluster.check() == []


def test_a_stop_carries_out_the_aborts_no_cycle_issued() -> None:
    """The last Occupy before a stop dropped a trajectory still on its instance: no cycle
    will come to abort it there, so the stop does (``abort_pending``), once."""
    cluster, decisions = _cluster(group_redundancy=0.5)
    assert cluster.loop.cycle()
    (surplus, other) = sorted(cluster.instances[0].holds())[:2]
    cluster.loop._drop((surplus,), ())
    assert surplus in cluster.instances[0].holds()
    assert cluster.loop.abort_pending() == 1
    assert decisions[-1] == Issued(cluster.now, (Abort(0, (surplus,)),))
    assert surplus not in cluster.instances[0].holds() and other in cluster.instances[0].holds()
    assert cluster.check() == []
    assert cluster.loop.abort_pending() == 0  # carried out: forgotten
    # counted in the speculative state as a cycle's Abort: the next snapshot is valid
    cluster.now += cluster.config.coordinator.period_s
    discarded = cluster.loop.coordinator.stats.discarded
    assert cluster.loop.cycle() and cluster.loop.coordinator.stats.discarded == discarded


def test_errors_that_are_not_late_news_stay_loud() -> None:
    """Only "already gone" is tolerated: dropping a trajectory or group the TS never had
    is a bug that must stop the loop."""
    cluster, _ = _cluster(group_redundancy=0.5)
    _start(cluster, 0, [0, 1])
    cluster.manager.reserve(0, 999, 0)  # a member the TS never created
    complete_live(cluster.ts, [_completion(0), _completion(1)])
    with pytest.raises(UnknownTrajectory, match="999"):
        cluster.loop.occupy([_Done(0, 0), _Done(0, 1)])
    cluster, _ = _cluster(batch_size=2, batch_redundancy=0.5)
    for g in (0, 1):
        _start(cluster, g, [2 * g, 2 * g + 1])
    cluster.manager.reserve(777, 5000, 0)  # a group the TS never created
    _reward(cluster, 0, [0, 1])
    with pytest.raises(UnknownGroup, match="777"):
        _reward(cluster, 1, [2, 3])


def test_a_route_that_finds_its_group_gone_gives_the_reserve_back() -> None:
    """Between the cycle's view and the delivery, the group left the TS (in a real run:
    the trainer's take_batch, or a drop). The Reserve made for it is released, and the
    group, which can no longer complete, is dropped."""
    cluster, decisions = _cluster()
    planes = cluster.planes
    submit = planes.submit

    def submit_after_the_group_left(inst, payloads, v_traj):
        if 0 in payloads and cluster.ts.stats().aborted_groups == 0:
            cluster.ts.abort_group(0)
        return submit(inst, payloads, v_traj)

    planes.submit = submit_after_the_group_left  # type: ignore[method-assign]
    cluster.loop.cycle()
    assert planes.claimed == set()
    assert cluster.manager.group_version(0) is None  # released, not left reserved
    assert any(isinstance(d, Dropped) and 0 in d.groups for d in decisions)
    assert cluster.check() == []


def test_the_loop_imports_no_framework() -> None:
    code = (
        "import sys, staleflow.control, staleflow.sim\n"
        "bad = [m for m in ('ray', 'torch', 'transformers', 'fastapi') if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


class _Stored:
    """A completion as the TS's ledger holds it (what a replay after a lost reward
    worker applies): with its response length, which Seer's length context reads."""

    def __init__(self, group_id: int, traj_id: int, response_len: int) -> None:
        self.group_id, self.traj_id, self.response_len = group_id, traj_id, response_len


def test_a_replay_applies_only_what_the_manager_lacks_and_tells_seer_once() -> None:
    """A lost reward worker stored completions in the TS, one of them already reported:
    the replay Occupies the other one only, and Seer's length context hears of each
    completion once (the skipped one would have raised the group's estimate to 99)."""
    from coordinator.config import SeerConfig

    seer = SeerConfig(enabled=True, chunk_tokens=16)
    cluster, _ = _cluster(coordinator=CoordinatorConfig(period_s=1.0, seer=seer))
    _start(cluster, 0, [0, 1])
    complete_live(cluster.ts, [_completion(0), _completion(1)])
    reported = _Stored(0, 0, 5)
    assert cluster.loop.occupy([reported]) == [reported]
    late = _Stored(0, 1, 7)
    assert cluster.loop.replay([_Stored(0, 0, 99), late]) == [late]
    context = cluster.loop.coordinator.strategies.seer
    assert context is not None and context.estimate(0) == 7
    assert cluster.manager.is_completed(0, 1)
