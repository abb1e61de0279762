"""The in-process executor and the concurrency rules of §5.2 / Figure 12(b)."""

from __future__ import annotations

from coordinator import (
    CommandDone,
    InProcessExecutor,
    Interrupt,
    Pull,
    Reservation,
    Route,
    TrajRecord,
)
from tests.coordinator.builders import manager
from tests.coordinator.fakes import FakeCluster, group


def setup(versions: dict[int, int], ps: int | None = None) -> tuple[FakeCluster, InProcessExecutor]:
    world = FakeCluster(versions, ps)
    m = manager(max(versions.values()) if ps is None else ps, eta=2, batch=8, group=2)
    return world, InProcessExecutor(world, world, world, m)


def test_route_waits_for_the_interrupt_that_returns_its_trajectory() -> None:
    world, ex = setup({0: 1, 1: 1})
    [t] = group(5, 1, first_traj=50, v_traj=1)
    world.place(0, [t])
    ex.block(("engine", 0))
    ex.issue([Interrupt(0, (50,)), Route(1, (50,))])
    for _ in range(3):
        ex.tick()
    assert world.where(50) == ["run:0"]  # the Route could not take it from the TS yet
    ex.unblock(("engine", 0))
    ex.run_until_idle()
    assert world.where(50) == ["run:1"]
    assert [d.command for d in ex.poll()] == [Interrupt(0, (50,)), Route(1, (50,))]


def test_trajectories_routed_to_a_pulling_instance_are_held_until_the_pull_ends() -> None:
    world, ex = setup({0: 1}, ps=2)
    old = group(1, 1, first_traj=10, v_traj=1)
    new = group(2, 2, first_traj=20)
    world.place(0, old)
    world.enqueue(new)
    ex.block(("pull", 0))
    route = Route(0, (20, 21), (Reservation(2, 20, 2), Reservation(2, 21, 2)))
    ex.issue([Interrupt(0, (10,)), Pull(0, 2), route])
    for _ in range(4):
        ex.tick()
    assert world.where(10) == ["ts"]  # interrupted
    assert world.where(20) == [] and world.where(21) == []  # taken from the TS, held
    assert world.instances[0].version == 1
    ex.unblock(("pull", 0))
    ex.run_until_idle()
    assert world.instances[0].version == 2
    assert world.where(20) == ["run:0"] and world.instances[0].running[20].v_traj == 2
    done = ex.poll()
    assert [d.command for d in done] == [Interrupt(0, (10,)), Pull(0, 2), route]
    assert done[1].loaded_version == 2


def test_commands_on_different_planes_complete_in_the_same_round() -> None:
    world, ex = setup({0: 1, 1: 0, 2: 0}, ps=1)
    world.place(0, group(1, 2, first_traj=10, v_traj=1))
    ex.issue([Interrupt(0, (10, 11)), Pull(1, 1), Pull(2, 1)])
    assert ex.tick() == 3  # an Interrupt and two Pulls (PS reads are shared)
    assert ex.pending == 0


def test_shortfalls_are_reported() -> None:
    world, ex = setup({0: 2, 1: 2}, ps=2)
    world.place(0, group(1, 2, first_traj=10, v_traj=2))
    world.finish(11)  # completes before the Interrupt lands
    world.enqueue(group(3, 1, first_traj=30))
    route = Route(1, (30, 31), (Reservation(3, 30, 2), Reservation(3, 31, 2)))
    ex.issue([Interrupt(0, (10, 11)), route])
    ex.run_until_idle()
    by_cmd = {type(d.command): d for d in ex.poll()}
    assert by_cmd[Interrupt].missed == (11,)
    assert by_cmd[Route].missed == (31,)  # the TS never had trajectory 31
    assert world.where(30) == ["run:1"] and world.where(10) == ["ts"]


def test_a_refused_reservation_leaves_the_trajectory_in_the_ts() -> None:
    world = FakeCluster({0: 3})
    m = manager(3, eta=0, batch=1)
    m.reserve(99, 99, 3)  # the only buffer is now taken
    ex = InProcessExecutor(world, world, world, m)
    world.enqueue([TrajRecord(1, 1, None, 100, 100)])
    route = Route(0, (1,), (Reservation(1, 1, 3),))
    ex.issue([route])
    ex.run_until_idle()
    assert ex.poll() == [CommandDone(route, missed=(1,))]
    assert world.where(1) == ["ts"] and world.ts[1].v_traj is None


def test_reservations_reach_the_staleness_manager() -> None:
    world = FakeCluster({0: 3})
    m = manager(3, eta=1, batch=2, group=2)
    ex = InProcessExecutor(world, world, world, m)
    world.enqueue(group(7, 2, first_traj=70))
    ex.issue([Route(0, (70, 71), (Reservation(7, 70, 3), Reservation(7, 71, 3)))])
    ex.run_until_idle()
    assert m.group_version(7) == 3


def test_trajectories_a_plane_could_not_start_are_reported_missed() -> None:
    """A plane that only claims at take time learns at delivery that a trajectory left the
    TS meanwhile; the Route's report must say so, or the speculative state drifts."""
    world, ex = setup({0: 1})
    [a, b] = group(3, 2, first_traj=30, v_traj=1)
    world.enqueue([a, b])
    original = world.submit

    def submit_all_but_31(inst, payloads, v_traj):
        original(inst, {t: p for t, p in payloads.items() if t != 31}, v_traj)
        return [31]

    world.submit = submit_all_but_31  # type: ignore[method-assign]
    ex.issue([Route(0, (30, 31))])
    ex.run_until_idle()
    [done] = ex.poll()
    assert done.missed == (31,)


def test_pending_and_issued_commands_by_instance() -> None:
    world, ex = setup({0: 1, 1: 1})
    [t] = group(5, 1, first_traj=50, v_traj=1)
    world.place(0, [t])
    ex.block(("engine", 0))
    ex.issue([Interrupt(0, (50,)), Route(1, (50,))])
    # the Route is two operations (take from the TS, deliver) but one command
    assert ex.pending_by_instance() == {0: 1, 1: 1}
    assert ex.issued == {0: {"interrupt": 1}, 1: {"route": 1}}
    ex.tick()
    assert ex.pending_by_instance() == {0: 1, 1: 1}  # the Route waits for the Interrupt
    ex.unblock(("engine", 0))
    ex.run_until_idle()
    assert ex.pending_by_instance() == {}
    ex.issue([Interrupt(0, ())])
    assert ex.issued == {0: {"interrupt": 2}, 1: {"route": 1}}
