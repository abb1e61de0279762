"""The terminal view of a run (what ``staleflow launch`` prints): the live panel draws
every staleness buffer and instance, the step line and the summary carry the run's
figures. Rendered with rich as the CLI does, then read back as text."""

from __future__ import annotations

import io

from rich.console import Console

from coordinator.types import InstanceSnapshot
from staleflow.progress import Progress
from staleflow.runfolder.run_summary import RunSummary
from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.controller.plane_records import LiveState
from staleflow.runtime.driver.display import LaunchView, live_panel, step_line, summary_table
from staleness import StalenessConfig, StalenessManager


def _text(renderable) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_live_panel_draws_each_buffer_as_slots_and_each_instance():
    manager = StalenessManager(StalenessConfig(eta=2, batch_size=2, group_size=1))
    manager.reserve(0, 0, 0)  # raises if refused
    manager.reserve(1, 1, 0)
    assert manager.complete(0, 0).occupied
    snapshots = tuple(InstanceSnapshot(i, 40 * i, (), (), (), inst_version=0) for i in range(3))
    live = LiveState(manager.view(), snapshots, None, 0, 0, 1, 2.0)
    text = _text(live_panel(live))
    assert "eta=2" in text
    rows = [line for line in text.splitlines() if "buffer " in line]
    assert len(rows) == 3  # versions 0, 1, 2: the window [v, v + eta]
    assert "│ O. " in rows[0]  # the occupied group, one free slot
    assert "│ r. " in rows[2]  # the reservation, kept as late as its window allows
    assert sum("instance " in line for line in text.splitlines()) == 3
    assert "kv 80 tok" in text


def test_step_line_and_summary_carry_the_figures():
    rec = StepRecord(
        step=7,
        version=7,
        elapsed_s=30.0,
        reward_mean=0.375,
        tokens_per_s=812.5,
        trainer_idle_ratio=0.1,
        instance_idle={0: 0.5, 1: 0.7},
        staleness={0: 3, 2: 5},
    )
    line = step_line(rec, eta=3)
    assert "step    7" in line and "0.375" in line and "812.5 tok/s" in line
    assert "staleness [0:3 2:5]" in line and "rollout 60%" in line
    summary = {
        "steps": 7,
        "tokens_per_s": 812.5,
        "eval_problems": 64,
        "eval_reward_start": 0.25,
        "eval_reward_end": 0.4,
        "staleness_hist": {0: 3, 2: 5},
        "time_share": {"pull": 0.01, "route": 0.02, "interrupt": 0.0},
    }
    text = _text(summary_table(RunSummary.from_json(summary), eta=3, run_dir="runs/x"))
    assert "0.250 → 0.400" in text and "runs/x" in text
    assert "1.00% / 2.00% / 0.00%" in text
    assert "812.5 trained tokens/s" in text
    assert "mean staleness; tokens clipped or masked" not in text or "-; -" in text
    summary |= {"staleness_mean": 1.25, "corrected_frac": 0.045}
    assert "1.25; 4.50%" in _text(summary_table(RunSummary.from_json(summary), eta=3))


# -- the waits before training ------------------------------------------------------------


def _terminal(width: int = 140) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=width, color_system=None), out


def test_a_terminal_gets_a_live_bar_with_steps_metrics_and_time_left():
    console, out = _terminal()
    clock = [0.0]
    view = LaunchView(console)
    assert view.terminal is not None  # a terminal: bars, not lines
    progress = Progress(view.terminal, clock=lambda: clock[0])
    with view:
        phase = progress.phase(
            "warmup", "warming up", total=1200, unit="steps", upper_bound=True, goal="accuracy 25%"
        )
        clock[0] = 40.0
        phase.update(done=300, loss=1.25, accuracy=0.125)
        drawn = _text(view.terminal._renderable())
        phase.finish("stopped at step 300")
        after = _text(view.terminal._renderable())
    assert "warming up" in drawn and "━" in drawn  # the bar
    assert "300/1200 steps" in drawn and "loss 1.25" in drawn and "accuracy 12.5%" in drawn
    assert "stops at accuracy 25%" in drawn and "at most 2m00s left" in drawn
    assert "warming up" not in after  # a finished phase leaves the live area ...
    printed = out.getvalue()
    assert "warming up: done in 40s, 300/1200 steps" in printed  # ... for a line above it
    assert "stopped at step 300" in printed


def test_output_that_is_not_a_terminal_gets_plain_lines():
    out = io.StringIO()
    console = Console(file=out, width=80)  # a pipe, a log file, nohup
    view = LaunchView(console, every_s=0)
    assert view.terminal is None and console.soft_wrap  # whole lines, never cut at 80
    with view, view.progress.phase("actors", "starting actors: " + "x" * 90, total=5) as phase:
        phase.advance(detail="Ray up")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("starting actors: xxx") and lines[0].endswith("... (5)")
    assert "1/5 (20%), Ray up" in lines[1]
    assert lines[-1].endswith("done in 0s, 1/5")
    assert "\x1b" not in out.getvalue()


def test_no_live_in_a_terminal_means_plain_lines_too():
    console, _ = _terminal()
    assert LaunchView(console, live=False).terminal is None


def test_the_buffers_panel_goes_when_training_ends():
    console, _ = _terminal()
    view = LaunchView(console)
    manager = StalenessManager(StalenessConfig(eta=1, batch_size=1, group_size=1))
    live = LiveState(manager.view(), (), None, 0, 0, 0, 1.0)
    with view:
        training = view.progress.phase("training", "training", total=2, unit="steps")
        view.on_tick(live)
        assert "buffer 0" in _text(view.terminal._renderable())
        training.finish()
        assert "buffer 0" not in _text(view.terminal._renderable())
