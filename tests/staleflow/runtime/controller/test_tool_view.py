"""The control plane's view of tool waits (runtime/controller/tool_view.py): what the
TS lists as waiting reaches the snapshot of the instance its turn ended on, cached
prefixes last until a Pull, the next route or the episode's end (unless the instance
lists its own), and the episodes' records warm-start the learned waits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from coordinator.agentic import ToolWaits
from coordinator.types import InstanceSnapshot, TrajRecord
from staleflow.runtime.controller.instances import Members
from staleflow.runtime.controller.tool_view import ToolWaitView
from staleflow.runtime.interface import InstanceGone, Rewarded
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


def test_an_instance_that_lists_its_prefixes_is_read_not_assumed_about() -> None:
    """Instance 0's engine lists what it keeps (``held_exact``): 8's prefix was evicted
    there and 5's kept from an earlier turn, and the view reports exactly that, adding
    nothing for the trajectories whose turns ended there. Instance 1 lists nothing, so
    its prefixes are assumed as before."""
    ts, view = _view(prefix_cache=True)
    ts.waiting = [
        (RoutableTrajectory(7, 1, 0, 60, 10), "inst-1"),
        (RoutableTrajectory(8, 1, 0, 50, 10), "inst-0"),
    ]
    exact = replace(_snap(0), held=((5, 30),), held_exact=True)
    out = view.merge([exact, _snap(1)], view.waiting())
    assert out[0].held == ((5, 30),) and out[0].held_exact
    assert [t.traj_id for t in out[0].env_trajs] == [8]  # waiting there all the same
    assert out[1].held == ((7, 60),) and not out[1].held_exact
    ts.waiting = []
    out = view.merge([replace(exact, held=()), _snap(1)], view.waiting())
    assert out[0].held == () and out[1].held == ((7, 60),)  # the engine dropped 5


class _Host:
    def __init__(self, gone: bool = False) -> None:
        self.gone = gone
        self.dropped: list[list[int]] = []

    def drop_prefixes(self, traj_ids: Sequence[int]) -> list[int]:
        if self.gone:
            raise InstanceGone(1, "its process died")
        self.dropped.append(list(traj_ids))
        return list(traj_ids)


def _ended(traj_id: int, instance: int) -> Rewarded:
    return Rewarded(traj_id, 1, 0, 1.0, "", 40, "stop", instance, turns=2, tool_calls=1,
                    tool_wait_s=0.5)  # fmt: skip


def test_an_ended_episode_is_forgotten_and_dropped_wherever_an_engine_lists_it() -> None:
    """Instances 0 and 2 list their prefixes; instance 1's engine keeps none it could
    name (vLLM, SGLang), so its prefixes are assumed and only forgotten. 8 ended on
    instance 0, whose list has it, and an earlier turn of 8 left a copy on instance 2
    (it moved from there); 9 ended on instance 0 after the snapshots were taken; 2 has
    since left the run."""
    ts = _TS()
    names = {0: "inst-0", 1: "inst-1", 2: "inst-2"}
    view = ToolWaitView(ts, lambda: names, prefix_cache=True)
    ts.waiting = [
        (RoutableTrajectory(7, 1, 0, 60, 10), "inst-1"),
        (RoutableTrajectory(8, 1, 0, 50, 10), "inst-0"),
    ]
    exact0 = replace(_snap(0), held=((8, 50),), held_exact=True)
    exact2 = replace(_snap(2), held=((8, 20),), held_exact=True)
    out = view.merge([exact0, _snap(1), exact2], view.waiting())
    assert out[1].held == ((7, 60),)  # assumed
    hosts = {0: _Host(), 1: _Host(), 2: _Host(gone=True)}
    waits = ToolWaits(min_samples=4)
    asked = view.rewarded([_ended(8, 0), _ended(7, 1), _ended(9, 0)], waits, Members(hosts, names))
    assert hosts[0].dropped == [[8, 9]] and hosts[1].dropped == []
    assert asked == 3  # 8 on instances 0 and 2 (gone: skipped), 9 on instance 0
    assert waits.samples == 3  # the records still warm-start the waits
    ts.waiting = []
    out = view.merge([replace(exact0, held=()), _snap(1), replace(exact2, held=())], view.waiting())
    assert out[1].held == ()  # ended: no next turn will want it
