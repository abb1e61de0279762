"""A simulated run as a source: the simulator's own thread, paced, sampled per cycle.

Every wait is on the source's own events (a published state, the pause taking hold), never
on a sleep or a deadline: pytest's timeout is the only guard against a hang."""

from __future__ import annotations

import pytest

from staleflow.dashboard.interface import ActionNotSupported
from staleflow.dashboard.sim_source import SimSource
from staleflow.sim import tiny


def test_a_finished_simulation_is_fully_recorded():
    src = SimSource(tiny(eta=1, steps=3), speed=1e6).start()
    try:
        assert src.wait(lambda live: live.finished)
        live = src.live()
        assert live.steps == 3 and live.buffers is not None and live.ts is not None
        assert len(live.buffers.buffers) == 2 and len(live.instances) == 4
        records = src.records(0, 100).items
        assert [r.step for r in records] == [1, 2, 3]
        for r in records:
            assert r.staleness and max(r.staleness) <= 1
            assert sum(r.staleness.values()) == r.trajectories
            assert r.tokens_per_s is not None and r.tokens_per_s > 0
            assert r.reward_mean is None  # the simulator grades no rewards: unknown, not 0
            assert set(r.instance_version) == {0, 1, 2, 3}
        events = src.events(0, 1000).items
        pulls = [e for e in events if e.kind == "pull"]
        assert {e.inst for e in pulls} == {0, 1, 2, 3}
        assert [e.version for e in events if e.kind == "step"] == [1, 2, 3]
        load = src.load(0, 100_000)
        assert load.total > 4 * 10 and {s.inst for s in load.items} == {0, 1, 2, 3}
        assert any(s.running for s in load.items)
        commands = [d.commands_total for d in live.instances]
        assert all(c and c.get("route", 0) > 0 for c in commands)
        ps = src.ps()
        assert ps.latest == live.ps_version and ps.held is None and ps.notes
    finally:
        src.close()


def test_pause_holds_the_simulation_and_resume_goes_on():
    src = SimSource(tiny(eta=1, steps=1000), speed=50.0).start()
    try:
        assert src.wait(lambda live: live.elapsed_s > 0)
        assert src.act("pause") == "paused" and src.paused
        assert src.wait_paused()
        # parked after publishing: what the page shows is where the simulation stands
        frozen = src.live()
        assert frozen.elapsed_s == src.cluster.now and not frozen.finished
        assert src.paused and src.wait_paused()  # still held: nothing moved in between
        assert src.live() is frozen
        assert src.act("resume") == "resumed" and not src.paused
        assert src.wait(lambda live: live.elapsed_s > frozen.elapsed_s)
        with pytest.raises(ActionNotSupported, match="unknown action"):
            src.act("explode")
    finally:
        src.close()
    # close ends the simulation long before its 1000 steps, and says so
    assert src.wait(lambda live: live.finished)
    assert src.live().steps < 1000


def test_close_while_paused_ends_the_simulation():
    src = SimSource(tiny(eta=1, steps=1000), speed=50.0).start()
    assert src.wait(lambda live: live.elapsed_s > 0)
    src.act("pause")
    assert src.wait_paused()
    src.close()
    assert src.wait(lambda live: live.finished)


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="speed"):
        SimSource(tiny(), speed=0)
    with pytest.raises(ValueError, match="unknown preset"):
        SimSource.from_preset("huge")
