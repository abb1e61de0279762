"""TS writes that tolerate late messages: a trajectory or group the TS already forgot is
skipped, everything else in the batch goes through, and every other error propagates."""

from __future__ import annotations

import numpy as np
import pytest

from staleflow.control.late import abort_groups_live, abort_live, complete_live, return_live
from trajectory_server import TrajectoryServer, TrajectoryServerConfig
from trajectory_server.errors import InvalidTransition, UnknownGroup, UnknownTrajectory
from trajectory_server.types import Completion, PartialTrajectory


class _Prompts:
    def __init__(self) -> None:
        self.n = 0

    def next_sample(self):
        from types import SimpleNamespace

        self.n += 1
        return SimpleNamespace(sample_id=self.n, prompt_ids=np.arange(3, dtype=np.int32), answer="")


class Counting:
    """The TS with its calls counted (one round trip each over Ray)."""

    def __init__(self, ts: TrajectoryServer) -> None:
        self.ts, self.calls = ts, 0

    def __getattr__(self, name):
        method = getattr(self.ts, name)

        def call(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return call


def _ts() -> TrajectoryServer:
    ts = TrajectoryServer(TrajectoryServerConfig(eta=0, batch_size=2, group_size=3), _Prompts())
    ts.route([0, 1, 2, 3, 4, 5], 0, 0)  # groups 0 and 1 on instance 0
    return ts


def _done(tid: int) -> Completion:
    one = np.ones(1, np.int32)
    return Completion(tid, one, np.zeros(1, np.float32), np.zeros(1, np.int32), 1.0, "stop", {})


def test_completions_of_aborted_trajectories_are_dropped_and_the_rest_stored() -> None:
    ts = _ts()
    ts.abort([1])  # e.g. group-redundancy surplus, aborted while being rewarded
    counted = Counting(ts)
    stored = complete_live(counted, [_done(0), _done(1), _done(2)])
    assert [c.traj_id for c in stored] == [0, 2]
    assert ts.group_status(0).completed == 2
    assert ts.stats().completed == 2


def test_a_batch_with_nothing_late_is_one_call() -> None:
    counted = Counting(_ts())
    assert len(complete_live(counted, [_done(0), _done(1)])) == 2
    assert counted.calls == 1


def test_a_wrong_completion_is_not_swallowed() -> None:
    ts = _ts()
    with pytest.raises(UnknownTrajectory, match="never created"):
        complete_live(ts, [_done(0), _done(999)])
    ts.complete(0, *_payload(), 1.0, "stop")
    with pytest.raises(InvalidTransition, match="COMPLETED"):
        complete_live(ts, [_done(0)])  # completed twice: a bug, not a late message


def _payload():
    return np.ones(1, np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32)


def test_partials_of_aborted_trajectories_are_dropped() -> None:
    ts = _ts()
    ts.abort_group(1)  # batch-redundancy surplus
    partials = [PartialTrajectory(t, *_payload()) for t in (2, 3, 4)]
    assert return_live(ts, partials) == [2]
    assert [t.traj_id for t in ts.routing_view()] == [2, 6, 7, 8]  # 6..8: refilled group


def test_aborts_skip_what_is_gone_and_refuse_what_never_was() -> None:
    ts = _ts()
    ts.abort([0])
    assert [a.traj_id for a in abort_live(ts, [0, 1])] == [1]
    with pytest.raises(UnknownTrajectory):
        abort_live(ts, [2, 999])
    assert [a.traj_id for a in abort_groups_live(ts, [0, 1])] == [2, 3, 4, 5]
    assert abort_groups_live(ts, [0, 1]) == []  # both gone now
    with pytest.raises(UnknownGroup, match="never created"):
        abort_groups_live(ts, [999])
