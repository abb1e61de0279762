"""A simulated run as a source: the simulator's own thread, paced, sampled per cycle."""

from __future__ import annotations

import time

import pytest

from staleflow.dashboard.sim_source import SimSource
from staleflow.sim import tiny


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_finished_simulation_is_fully_recorded():
    src = SimSource(tiny(eta=1, steps=3), speed=1e6).start()
    try:
        _wait(lambda: src.live().finished)
        live = src.live()
        assert live.steps == 3 and live.buffers is not None and live.ts is not None
        assert len(live.buffers.buffers) == 2 and len(live.instances) == 4
        records = src.records(0, 100).items
        assert [r["step"] for r in records] == [1.0, 2.0, 3.0]
        for r in records:
            hist = {int(k.rsplit("/", 1)[1]) for k in r if k.startswith("staleness/hist/")}
            assert hist and max(hist) <= 1
            assert r["throughput/tokens_per_s"] > 0
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


def test_pause_resume_and_close():
    src = SimSource(tiny(eta=1, steps=1000), speed=50.0, frame_s=0.0).start()
    try:
        _wait(lambda: src.live().elapsed_s > 0)
        assert src.act("pause") == "paused" and src.paused
        time.sleep(0.3)
        frozen = src.live().elapsed_s
        time.sleep(0.4)
        assert src.live().elapsed_s == frozen
        src.act("resume")
        _wait(lambda: src.live().elapsed_s > frozen)
        with pytest.raises(Exception, match="unknown action"):
            src.act("explode")
    finally:
        started = time.monotonic()
        src.close()
        assert time.monotonic() - started < 3.0
    assert not src._thread.is_alive()
    assert src.live().finished


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="speed"):
        SimSource(tiny(), speed=0)
    with pytest.raises(ValueError, match="unknown preset"):
        SimSource.from_preset("huge")
