"""The terminal view of a run (what ``staleflow launch`` prints): the live panel draws
every staleness buffer and instance, the step line and the summary carry the run's
figures. Rendered with rich as the CLI does, then read back as text."""

from __future__ import annotations

from rich.console import Console

from coordinator.types import InstanceSnapshot
from staleflow.runtime.control import LiveState
from staleflow.runtime.display import live_panel, step_line, summary_table
from staleflow.runtime.record import StepRecord
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
    text = _text(summary_table(summary, eta=3))
    assert "0.250 → 0.400" in text
    assert "1.00% / 2.00% / 0.00%" in text
    assert "812.5 trained tokens/s" in text
