"""The control plane's view of tool waits (runtime/controller/tool_view.py): what the
TS lists as waiting reaches the snapshot of the instance its turn ended on, cached
prefixes last until a Pull or the next route, and the episodes' records warm-start the
learned waits."""

from __future__ import annotations

from coordinator.agentic import ToolWaits
from coordinator.types import InstanceSnapshot, TrajRecord
from staleflow.runtime.controller.tool_view import ToolWaitView
from staleflow.runtime.interface import Rewarded
from trajectory_server.types import RoutableTrajectory


class _TS:
    def __init__(self) -> None:
        self.waiting: list[tuple[RoutableTrajectory, str]] = []

    def tool_waits(self) -> tuple[tuple[RoutableTrajectory, str], ...]:
        return tuple(self.waiting)


def _snap(inst: int, version: int = 0, run: tuple[int, ...] = ()) -> InstanceSnapshot:
    trajs = tuple(TrajRecord(t, 0, 0, 40, 10) for t in run)
    return InstanceSnapshot(inst, 40 * len(run), trajs, (), (), version)


def _view(prefix_cache: bool) -> tuple[_TS, ToolWaitView]:
    ts = _TS()
    return ts, ToolWaitView(ts, lambda: {0: "inst-0", 1: "inst-1"}, prefix_cache=prefix_cache)


def test_waiting_trajectories_are_listed_on_the_instance_their_turn_ended_on() -> None:
    ts, view = _view(prefix_cache=False)
    ts.waiting = [
        (RoutableTrajectory(7, 1, 0, 60, 10), "inst-1"),
        (RoutableTrajectory(8, 1, 0, 50, 10), "inst-0"),
        (RoutableTrajectory(9, 2, 0, 50, 10), "inst-gone"),  # its instance left the run
        (RoutableTrajectory(3, 2, 0, 50, 10), "inst-0"),  # on an instance already
    ]
    out = view.merge([_snap(0, run=(3,)), _snap(1)], view.waiting())
    assert [t.traj_id for t in out[0].env_trajs] == [8]
    assert [(t.traj_id, t.length) for t in out[1].env_trajs] == [(7, 60)]
    assert out[0].run_trajs == _snap(0, run=(3,)).run_trajs  # decoding work untouched
    assert out[0].held == out[1].held == ()  # no prefix cache: nothing held


def test_a_cached_prefix_lasts_until_the_instance_pulls_or_the_trajectory_is_routed() -> None:
    ts, view = _view(prefix_cache=True)
    ts.waiting = [
        (RoutableTrajectory(7, 1, 0, 60, 10), "inst-1"),
        (RoutableTrajectory(8, 1, 0, 50, 10), "inst-0"),
    ]
    out = view.merge([_snap(0), _snap(1)], view.waiting())
    assert out[0].held == ((8, 50),) and out[1].held == ((7, 60),)
    ts.waiting = []  # both answered: queued for their next turns, prefixes still cached
    out = view.merge([_snap(0), _snap(1)], view.waiting())
    assert out[0].held == ((8, 50),) and out[1].held == ((7, 60),)
    assert out[0].env_trajs == out[1].env_trajs == ()
    # 8 is routed (to instance 0, running again); instance 1 Pulled version 1
    out = view.merge([_snap(0, run=(8,)), _snap(1, version=1)], view.waiting())
    assert out[0].held == out[1].held == ()


def _rewarded(calls: int, wait_s: float) -> Rewarded:
    return Rewarded(1, 1, 0, 1.0, "", 40, "stop", 0, turns=calls + 1, tool_calls=calls,
                    tool_wait_s=wait_s)  # fmt: skip


def test_records_warm_start_the_learned_waits_until_snapshots_measured_enough() -> None:
    _, view = _view(prefix_cache=False)
    waits = ToolWaits(min_samples=3, prior_wait_s=30.0)
    view.learn([_rewarded(0, 0.0), _rewarded(2, 3.0)], waits)  # a 1.5 s mean per call
    assert waits.samples == 2 and view.learned == 2
    assert waits.quantile(0.5) > 10.0  # fewer than min_samples: the prior still answers
    view.learn([_rewarded(2, 3.0)], waits)
    assert waits.samples == 4 and waits.quantile(0.5) == 1.5
    view.learn([_rewarded(3, 60.0)], waits)  # enough measured: records add nothing
    assert waits.samples == 4 and view.learned == 4
    view.learn([_rewarded(3, 6.0)], None)  # no rule uses the waits: nothing to learn
