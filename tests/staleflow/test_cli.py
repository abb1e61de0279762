"""The command line and the protocol demo."""

from __future__ import annotations

import subprocess
import sys

from staleflow.cli import main
from staleflow.demo import run_demo


def test_demo_respects_eta_and_eta_zero_is_on_policy():
    for eta in (0, 1, 3):
        result = run_demo(eta=eta, steps=6, seed=eta)
        assert result.batches == 6
        assert max(result.staleness) <= eta
        assert sum(result.staleness.values()) == 6 * 8
    assert set(run_demo(eta=0, steps=4).staleness) == {0}


def test_larger_eta_finishes_the_same_steps_sooner():
    assert run_demo(eta=3, steps=8).ticks < run_demo(eta=0, steps=8).ticks


def test_cli_demo_and_bad_eta(capsys):
    assert main(["demo", "--eta", "2", "--steps", "3"]) == 0
    assert "max staleness" in capsys.readouterr().out
    assert main(["demo", "--eta", "-1"]) == 2
    assert "--eta must be >= 0" in capsys.readouterr().err


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "staleflow.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "demo" in out.stdout


def test_cli_sim_prints_a_summary_and_writes_json(capsys, tmp_path):
    out = tmp_path / "sim.json"
    assert main(["sim", "--preset", "tiny", "--eta", "1", "--steps", "3", "--json", str(out)]) == 0
    assert "throughput" in capsys.readouterr().out
    import json

    summary = json.loads(out.read_text())
    assert summary["steps"] == 3 and max(int(k) for k in summary["staleness"]) <= 1


def test_cli_sim_unknown_system_is_a_clear_error(capsys):
    assert main(["sim", "--system", "nonsense", "--steps", "1"]) == 2
    assert "unknown system" in capsys.readouterr().err
