"""The command line and the protocol demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    summary = json.loads(out.read_text())
    assert summary["steps"] == 3 and max(int(k) for k in summary["staleness"]) <= 1


def test_cli_sim_runs_an_agentic_workload_of_the_matrix(capsys, tmp_path):
    out = tmp_path / "agentic.json"
    argv = ["sim", "--workload", "search-agent", "--small", "--steps", "2", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "simulated staleflow on search-agent" in printed
    assert "coordinator decision, CPU ms" in printed and "at tools" in printed
    summary = json.loads(out.read_text())
    assert summary["steps"] == 2 and max(map(int, summary["staleness"])) <= 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--workload", "nonsense"], "use one of"),
        (["--small"], "go with --workload"),
        (["--workload", "swe-agent", "--small", "--rollout-gpus", "99"], "rollout_gpus=99"),
        (["--workload", "swe-agent", "--small", "--rollout-gpus", "12"], "rollout_gpus=12"),
        (["--workload", "swe-agent", "--gpus", "1"], "at least 2 GPUs"),
        (["--gpus", "256"], "go with --workload"),
    ],
)
def test_cli_sim_bad_workload_arguments_are_clear_errors(capsys, argv, says):
    assert main(["sim", "--steps", "1", *argv]) == 2
    assert says in capsys.readouterr().err


def test_cli_sim_gpus_sizes_the_workloads_cluster(capsys):
    """--gpus 256 doubles the cluster (16 GPUs at --small's scale instead of 8), so 12
    rollout instances fit where the workload's own size refuses them (above)."""
    argv = ["sim", "--workload", "search-agent", "--small", "--gpus", "256"]
    assert main([*argv, "--rollout-gpus", "12", "--steps", "1"]) == 0
    assert "12 instances" in capsys.readouterr().out


def test_cli_sim_unknown_system_is_a_clear_error(capsys):
    assert main(["sim", "--system", "nonsense", "--steps", "1"]) == 2
    assert "unknown system" in capsys.readouterr().err


# -- the operator's commands: dashboard, status, profile -------------------------------


def _run_folder(tmp_path):
    import json

    from staleflow.config import RunConfig, save_config

    run = tmp_path / "20250101-000000-eta1"
    run.mkdir()
    save_config(RunConfig(eta=1), run / "config.yaml")
    rec = {
        "step": 1.0,
        "version": 0.0,
        "time/elapsed_s": 3.0,
        "throughput/tokens_per_s": 42.0,
        "trainer/idle_ratio": 0.5,
        "rollout/reward_mean": 0.75,
        "staleness/hist/0": 8.0,
        "rollout/idle_ratio/0": 0.25,
        "rollout/version/0": 0.0,
    }
    (run / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 1, "tokens_per_s": 42.0}))
    return run


def test_operator_commands_have_help(capsys):
    for command, words in (
        ("dashboard", ("--address", "--sim", "--token", "--port")),
        ("status", ("--address", "--run")),
        ("profile", ("--output", "--running", "--lengths")),
        ("launch", ("--dashboard", "--no-dashboard")),
        ("sim", ("Simulate", "--preset", "paper-6.5", "--system", "--eta")),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        for word in words:
            assert word in out, (command, word)


def test_importing_the_cli_does_not_import_the_web_stack():
    code = "import sys, staleflow, staleflow.cli; print('fastapi' in sys.modules or 'uvicorn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_status_of_a_run_folder(capsys, tmp_path):
    assert main(["status", str(_run_folder(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "20250101-000000-eta1" in out and "finished" in out
    assert "42.0 tokens/s" in out and "0:8" in out and "summary.json" in out


def test_cli_status_and_dashboard_need_one_run(capsys, tmp_path):
    assert main(["status"]) == 2
    assert "name one run" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["dashboard", str(tmp_path), "--sim", "tiny", "--port", "0"]) == 2
    assert "name one run" in capsys.readouterr().err


def test_cli_dashboard_serves_a_simulated_run_until_interrupted():
    import json
    import signal
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "staleflow.cli", "dashboard", "--sim", "tiny", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "staleflow dashboard at http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split()[3]
        with urllib.request.urlopen(url + "api/run", timeout=10) as r:
            run = json.load(r)
        assert run["kind"] == "sim" and run["eta"] == 1 and run["instances"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_profile_fits_and_saves_a_config_launch_reads(capsys, tmp_path):
    from staleflow.config import load_config

    out = tmp_path / "cost.yaml"
    argv = ["profile", "--preset", "micro", "--max-running", "8", "--kv-budget", "1024"]
    argv += ["--running", "1,2,4,8", "--lengths", "8,32", "--steps", "2", "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "saved to" in printed and "coordinator.cost_model.k1=" in printed
    cfg = load_config(out)
    model = cfg.coordinator.cost_model.build()
    assert model.kv_budget == 1024 and model.k2 + model.k4 > 0
    assert cfg.rollout.kv_budget_tokens == 1024 and cfg.rollout.max_running == 8
    assert cfg.coordinator.period_s == 0.2  # the rest keeps launch's defaults
    assert main(["profile", "--running", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_launch_overrides_may_follow_options():
    from staleflow.cli import parse_args

    args = parse_args(["launch", "seed=1", "--eta", "3", "--no-dashboard", "run_dir=/tmp/x"])
    assert args.overrides == ["seed=1", "run_dir=/tmp/x"]
    assert args.eta == 3 and args.dashboard is False


def test_unknown_arguments_are_still_refused(capsys):
    from staleflow.cli import parse_args

    for argv in (["launch", "--eta", "3", "--bogus"], ["sim", "steps=3"]):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_cli_dashboard_port_out_of_range_is_a_clear_error(capsys):
    pytest.importorskip("uvicorn")
    assert main(["dashboard", "--sim", "tiny", "--port", "70000"]) == 2
    assert "1..65535" in capsys.readouterr().err


def test_cli_profile_refuses_a_folder_as_output_before_profiling(capsys, tmp_path):
    assert main(["profile", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr()
    assert "is a folder" in err.err and "n=" not in err.out  # nothing was timed


def test_cli_launch_interrupted_says_so_without_a_traceback(capsys, monkeypatch):
    # the command module holds its own name for launch (staleflow/commands/launch.py)
    from staleflow.commands import launch as launching

    def interrupted(cfg, **kwargs):
        # launch's own teardown (its finally blocks) has run by the time this propagates
        raise KeyboardInterrupt

    monkeypatch.setattr(launching, "launch", interrupted)
    try:
        code = main(["launch", "--no-dashboard", "--no-live", "--steps", "1"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C reached the caller (a traceback for the user)")
    assert code == 130
    out = capsys.readouterr().out
    assert "interrupted, the actors stopped" in out and "Traceback" not in out


def test_cli_launch_prints_the_final_table_from_the_typed_summary(capsys, monkeypatch):
    from staleflow.commands import launch as launching
    from staleflow.runfolder.run_summary import RunSummary
    from staleflow.runtime.driver.launch import RunResult

    summary = RunSummary.from_json(
        {"steps": 1, "elapsed_s": 2.5, "tokens_per_s": 40.0, "staleness_hist": {"0": 8}}
    )

    def finished(cfg, **kwargs):
        return RunResult(Path("runs/r1"), [], summary)  # short: the table is 80 wide

    monkeypatch.setattr(launching, "launch", finished)
    assert main(["launch", "--no-dashboard", "--no-live", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "40.0 trained tokens/s" in out and "2.5 s" in out and "0:8" in out
    assert "runs/r1" in out  # the run folder, no longer a key of the summary
