"""Phases of the long waits: their state, the time left, and the plain-line renderer used
when output is not a terminal (the terminal one is in tests/staleflow/runtime/driver/test_display.py)."""

from __future__ import annotations

import io
import threading

import pytest

from staleflow.progress import (
    SILENT,
    LatestLine,
    PhaseState,
    PlainLines,
    Progress,
    duration,
    progress_line,
)


class Clock:
    """A hand-driven clock: nothing here depends on how fast the machine is."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, PhaseState]] = []

    def started(self, state: PhaseState) -> None:
        self.events.append(("started", state))

    def updated(self, state: PhaseState) -> None:
        self.events.append(("updated", state))

    def finished(self, state: PhaseState) -> None:
        self.events.append(("finished", state))


def test_a_phase_reports_its_steps_metrics_and_time_left():
    clock, seen = Clock(), Recorder()
    progress = Progress(seen, clock=clock)
    phase = progress.phase("warmup", "warming up", total=100, unit="steps")
    clock.now += 10
    phase.advance(20, loss=2.5)
    (state,) = progress.snapshot()
    assert (state.done, state.total, state.metrics["loss"]) == (20, 100, 2.5)
    assert state.elapsed_s == 10 and state.left_s == pytest.approx(40.0)  # 80 more at 2/s
    clock.now += 5
    assert progress.snapshot()[0].elapsed_s == 15  # a running phase ages between updates
    phase.update(done=50, accuracy=0.1)
    assert progress.snapshot()[0].metrics == {"loss": 2.5, "accuracy": 0.1}
    phase.finish("target reached")
    final = progress.snapshot()[0]
    assert final.finished and not final.failed and final.note == "target reached"
    assert final.left_s is None and progress.current() is None
    phase.advance(5)  # a finished phase ignores late updates
    assert progress.snapshot()[0].done == 50
    assert [kind for kind, _ in seen.events] == ["started", "updated", "updated", "finished"]
    assert final.as_dict()["metrics"] == {"loss": 2.5, "accuracy": 0.1}


def test_a_phase_left_by_an_exception_is_failed_and_the_error_goes_on():
    progress = Progress(clock=Clock())
    with pytest.raises(RuntimeError), progress.phase("actors", "starting actors", total=5):
        raise RuntimeError("boom")
    (state,) = progress.snapshot()
    assert state.finished and state.failed and "RuntimeError" in state.note


def test_silent_phases_keep_nothing_and_print_nothing():
    with SILENT.phase("scoring", "scoring", total=3) as phase:
        phase.advance(2, reward=0.5)
        assert phase.state.done == 0


def test_the_time_left_is_an_upper_bound_for_a_phase_that_may_stop_early():
    clock = Clock()
    progress = Progress(clock=clock)
    phase = progress.phase("warmup", "warming up", total=1200, unit="steps", upper_bound=True)
    clock.now += 30
    phase.update(done=300, loss=1.0, accuracy=0.125)
    line = progress_line(progress.snapshot()[0])
    assert "300/1200 steps (25%)" in line
    assert "at most 1m30s left" in line and "accuracy 12.5%" in line and "loss 1" in line


def test_plain_lines_start_then_at_most_one_line_per_period_then_the_end():
    clock, out = Clock(), io.StringIO()
    progress = Progress(PlainLines(out, every_s=10, clock=clock), clock=clock)
    phase = progress.phase(
        "warmup", "warming up", total=1000, unit="steps", upper_bound=True, goal="accuracy 25%"
    )
    for _ in range(30):  # 30 steps, one a second
        clock.now += 1
        phase.advance(loss=1.5)
    phase.finish("stopped at step 30")
    lines = out.getvalue().splitlines()
    assert lines[0] == "warming up ... (at most 1000 steps, stops at accuracy 25%)"
    periodic = lines[1:-1]
    assert len(periodic) == 3  # at 10, 20 and 30 seconds; never a line per step
    assert periodic[0].startswith("warming up: 10/1000 steps (1%), loss 1.5")
    assert "10s elapsed, at most 16m30s left" in periodic[0]
    assert lines[-1] == "warming up: done in 30s, 30/1000 steps, loss 1.5, stopped at step 30"
    assert not any("\x1b" in line for line in lines)  # no terminal control codes in a log


def test_phases_without_a_total_and_concurrent_updates():
    clock, out = Clock(), io.StringIO()
    progress = Progress(PlainLines(out, every_s=0, clock=clock), clock=clock)
    phase = progress.phase("first_buffer", "waiting", unit="groups")

    def bump() -> None:
        for _ in range(200):
            phase.advance()

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = progress.snapshot()[0]
    assert state.total is None and state.left_s is None
    assert state.done == 800  # no advance lost to a race
    assert progress_line(state).startswith(f"waiting: {state.done:g} groups")


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0s"), (59.6, "1m00s"), (61, "1m01s"), (3725, "1h02m")]
)
def test_durations(seconds, text):
    assert duration(seconds) == text


def test_a_renderer_added_later_hands_on_the_line_of_each_change():
    # what `staleflow launch` gives the dashboard once it is up: the page's phase field
    clock, shown = Clock(), []
    progress = Progress(clock=clock)
    before = progress.phase("warmup", "warming up", total=10, unit="steps")
    before.finish()
    progress.add_renderer(LatestLine(shown.append))
    assert shown == []  # a wait that ended before the page was up is not replayed
    with progress.phase(
        "first_buffer", "waiting for the first buffer", total=4, unit="groups"
    ) as p:
        assert shown == ["waiting for the first buffer: 0/4 groups, 0s elapsed"]
        clock.now += 2
        p.update(done=1)
        assert shown[-1] == "waiting for the first buffer: 1/4 groups (25%), 2s elapsed, ~6s left"
    assert shown[-1].startswith("waiting for the first buffer: done in 2s, 1/4 groups")
