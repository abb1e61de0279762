"""The Figure scripts (experiments/sim_*.py) over real run folders (``--runs``): fake
folders written by hand with the keys ``staleflow.runtime.controller.metrics`` emits, the files and
tables the scripts write from them, and the errors for folders they cannot read. No Ray,
no torch."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from staleflow.config import RunConfig, save_config
from staleflow.runfolder.reader import RunFolderError, read_run_folder
from staleflow.runfolder.step_record import StepRecord, instance_steps, step_busy
from tests.support.experiments import load

pytest.importorskip("matplotlib")


INSTANCES = 2
IDLE = (0.1, 0.3)  # cumulative idle ratio per instance, constant: every step alike
SHARES = {"pull": 0.01, "route": 0.002, "interrupt": 0.003, "prefill": 0.1, "decode": 0.6}


def record(step: int, *, eta: int, step_s: float, tokens: float) -> dict[str, float]:
    """One step as ``StepMetrics.on_step`` writes it: instance 0 pulls every step,
    instance 1 every other step; batches hold 8 trajectories, staleness up to eta."""
    elapsed = step_s * step
    stale = min(step - 1, eta)
    hist = {0: 8 - stale, **({stale: stale} if stale else {})}
    rec: dict[str, float] = {
        "step": float(step),
        "version": float(step - 1),
        "time/elapsed_s": elapsed,
        "time/step_s": step_s,
        "throughput/tokens_per_s": tokens * step / elapsed,
        "throughput/step_tokens_per_s": tokens / step_s,
        "train/tokens": tokens,
        "train/trajectories": 8.0,
        "trainer/wait_s": 0.25 * step_s,
        "trainer/train_s": 0.7 * step_s,
        "trainer/push_wait_s": 0.0,
        "trainer/idle_ratio": 0.25,
        "rollout/rewarded": 8.0,
        "rollout/reward_errors": 0.0,
        "rollout/truncated": 1.0,
        "rollout/reward_mean": 0.1 * step,
        "rollout/response_len_mean": 20.0,
        "ps/version": float(step),
        "coordinator/cycles": 10.0 * step,
        "coordinator/discarded": 0.0,
        "coordinator/commands": 3.0 * step,
        "coordinator/decision_ms": 0.4,
        "coordinator/latency_s/pull": 0.05 * step,
        "staleness/mean": sum(k * n for k, n in hist.items()) / 8,
        "staleness/max": float(max(hist)),
        "train/loss": 0.5,
        "train/grad_norm": 1.0,
    }
    for k, n in hist.items():
        rec[f"staleness/hist/{k}"] = float(n)
    for kind, share in SHARES.items():
        rec[f"rollout/time_share/{kind}"] = share
    rec["rollout/time_share/commands"] = SHARES["pull"] + SHARES["route"] + SHARES["interrupt"]
    for inst in range(INSTANCES):
        rec[f"rollout/idle_ratio/{inst}"] = IDLE[inst]
        rec[f"rollout/version/{inst}"] = float(step - 1 if inst == 0 else 2 * ((step - 1) // 2))
    rec["rollout/idle_ratio"] = sum(IDLE) / INSTANCES
    return rec


def run_folder(
    root: Path,
    name: str,
    *,
    eta: int,
    steps: int = 6,
    step_s: float = 2.0,
    tokens: float = 100.0,
    finished: bool = True,
    routing: str = "throughput",
) -> Path:
    run = root / name
    run.mkdir(parents=True)
    cfg = RunConfig(eta=eta, steps=steps)
    strategies = {"routing": routing, "synchronization": routing, "migration": routing}
    cfg = dataclasses.replace(cfg, coordinator=dataclasses.replace(cfg.coordinator, **strategies))
    save_config(cfg, run / "config.yaml")
    records = [record(s, eta=eta, step_s=step_s, tokens=tokens) for s in range(1, steps + 1)]
    with (run / "metrics.jsonl").open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    if finished:
        last = records[-1]
        (run / "summary.json").write_text(
            json.dumps({"steps": steps, "tokens_per_s": last["throughput/tokens_per_s"]})
        )
    return run


def _script(name: str) -> ModuleType:
    return load(name)


def _rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(path.read_text())
    with path.with_suffix(".csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    return rows


def _main(name: str, tmp_path: Path, *args: Any) -> Path:
    out = tmp_path / "out" / name
    assert _script(name).main(["--out", str(out), "--runs", *map(str, args)]) == 0
    return out


# -- the shared reader --------------------------------------------------------------------


def test_reader_derives_busy_share_pulls_and_steady_throughput(tmp_path: Path) -> None:
    run = read_run_folder(run_folder(tmp_path, "r", eta=2, steps=6, tokens=120.0))
    assert run.eta == 2 and run.steps == 6 and run.finished and run.system == "staleflow"
    assert run.tokens_per_s == pytest.approx(60.0)
    # after the first eta + 1 = 3 steps: 3 x 120 tokens over steps 4..6 (6 s)
    assert run.steady_tokens_per_s() == pytest.approx(60.0)
    assert run.staleness_total() == {0: 8 * 6 - 1 - 2 * 4, 1: 1, 2: 8}
    assert run.time_shares()["decode"] == 0.6
    steps = run.instance_steps()
    assert len(steps) == 6 * INSTANCES
    assert [round(s.busy_ratio or 0, 6) for s in steps if s.inst == 1] == [0.7] * 6
    assert [s.step for s in steps if s.pulled and s.inst == 0] == [2, 3, 4, 5, 6]
    assert [(s.step, s.version) for s in steps if s.pulled and s.inst == 1] == [(3, 2), (5, 4)]


def test_step_busy_from_cumulative_idle_ratio() -> None:
    prev = StepRecord(step=1, version=0, elapsed_s=10.0, instance_idle={0: 0.5})
    rec = StepRecord(step=2, version=1, elapsed_s=20.0, instance_idle={0: 0.25})
    # idle 5 s of the first 10, 0 s of the next 10
    assert step_busy(rec, prev, 0) == pytest.approx(1.0)
    assert step_busy(rec, None, 0) == pytest.approx(0.75)
    assert step_busy(rec, prev, 1) is None
    # instances start with version 0: a first record at version 1 is a Pull
    first = instance_steps(dataclasses.replace(rec, instance_version={0: 1}), None)
    assert first[0].pulled and first[0].version == 1


def test_steady_throughput_needs_a_step_after_the_warm_up(tmp_path: Path) -> None:
    assert read_run_folder(run_folder(tmp_path, "r", eta=3, steps=4)).steady_tokens_per_s() is None


# -- Figure 18 ----------------------------------------------------------------------------


def test_staleness_from_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = run_folder(tmp_path / "runs", "20250101-000000-eta2", eta=2, steps=5)
    b = run_folder(tmp_path / "runs", "20250101-000100-eta0", eta=0, steps=3)
    out = _main("sim_staleness", tmp_path, a, b)
    rows = _rows(out / "staleness.json")
    assert [(r["run"], r["step"]) for r in rows] == [(a.name, s) for s in range(1, 6)] + [
        (b.name, s) for s in range(1, 4)
    ]
    for r in rows:
        assert r["trajectories"] == sum(r[f"staleness_{k}"] for k in range(3)) == 8
        assert r["buffer_version"] == r["step"] - 1
    assert [r["max_staleness"] for r in rows] == [0, 1, 2, 2, 2, 0, 0, 0]
    assert [r["staleness_2"] for r in rows if r["run"] == a.name] == [0, 0, 2, 2, 2]
    assert (out / "staleness.png").stat().st_size > 0
    shown = capsys.readouterr().out
    assert f"run {a.name} eta=2" in shown and f"run {b.name} eta=0" in shown


# -- Figure 17 ----------------------------------------------------------------------------


def test_instance_load_from_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_folder(tmp_path, "20250101-000000-eta1", eta=1, steps=4)
    out = _main("sim_instance_load", tmp_path, run)
    loads, syncs = _rows(out / "instance_load.json"), _rows(out / "syncs.json")
    assert len(loads) == 4 * INSTANCES
    assert {r["run"] for r in loads} == {run.name} and {r["system"] for r in loads} == {"staleflow"}
    assert [round(r["busy_ratio"], 6) for r in loads if r["inst"] == 0] == [0.9] * 4
    assert [r["time"] for r in loads if r["inst"] == 0] == [2.0, 4.0, 6.0, 8.0]
    assert [(s["inst"], s["step"], s["version"]) for s in syncs] == [
        (0, 2, 1),
        (0, 3, 2),
        (1, 3, 2),
        (0, 4, 3),
    ]
    assert (out / "instance_load.png").stat().st_size > 0
    shown = capsys.readouterr().out
    assert run.name in shown and "mean_busy" in shown


# -- Figure 13 / Table 3 ------------------------------------------------------------------


def test_eta_sweep_from_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    sync = run_folder(root, "a-eta0", eta=0, steps=6, step_s=4.0)
    fast = run_folder(root, "b-eta2", eta=2, steps=6, step_s=2.0)
    again = run_folder(root, "c-eta2", eta=2, steps=6, step_s=2.5, finished=False)
    other = run_folder(root, "d-vanilla", eta=1, steps=6, routing="vanilla")
    out = _main("sim_eta_sweep", tmp_path, fast, sync, again, other)

    rows = {r["run"]: r for r in _rows(out / "sweep.json")}
    assert [r["run"] for r in _rows(out / "sweep.json")] == [
        "a-eta0",
        "b-eta2",
        "c-eta2",
        "d-vanilla",
    ]
    assert rows["a-eta0"]["name"] == "staleflow" and rows["d-vanilla"]["name"] == "vanilla"
    assert rows["a-eta0"]["tokens_per_s"] == pytest.approx(25.0)
    assert rows["b-eta2"]["tokens_per_s"] == pytest.approx(50.0)
    assert rows["b-eta2"]["steady_tokens_per_s"] == pytest.approx(50.0)
    assert rows["b-eta2"]["staleness_max"] == 2 and rows["a-eta0"]["staleness_max"] == 0
    assert rows["b-eta2"]["staleness"] == {"0": 39, "1": 1, "2": 8}
    assert rows["b-eta2"]["time_share_decode"] == 0.6
    assert rows["b-eta2"]["time_share_commands"] == pytest.approx(0.015)
    assert rows["b-eta2"]["trainer_idle_ratio"] == pytest.approx(0.25)
    assert rows["b-eta2"]["finished"] and not rows["c-eta2"]["finished"]
    assert rows["b-eta2"]["reward_start"] == pytest.approx(0.1)

    stats = {(r["name"], r["eta"]): r for r in _rows(out / "sweep_stats.json")}
    mine = stats["staleflow", 2]
    assert mine["runs"] == ["b-eta2", "c-eta2"] and mine["unfinished"] == 1
    assert mine["tokens_per_s_mean"] == pytest.approx((50.0 + 40.0) / 2)
    assert mine["tokens_per_s_min"] == pytest.approx(40.0)

    gains = _rows(out / "gains.json")
    assert [(g["name"], g["eta"], g["baseline"]) for g in gains] == [("staleflow", 2, "eta=0")]
    g = gains[0]
    assert g["gain"] == pytest.approx(45.0 / 25.0)
    assert (g["gain_min"], g["gain_max"]) == (pytest.approx(1.6), pytest.approx(2.0))
    assert g["baseline_runs"] == ["a-eta0"]
    assert g["steady_gain"] == pytest.approx(45.0 / 25.0)
    assert (out / "eta_sweep.png").stat().st_size > 0

    shown = capsys.readouterr().out
    assert "staleflow eta=2 over eta=0: 1.800 [1.600..2.000]x" in shown
    assert "c-eta2 has no summary.json" in shown


def test_eta_sweep_without_an_eta0_run_has_no_gains(tmp_path: Path) -> None:
    out = _main("sim_eta_sweep", tmp_path, run_folder(tmp_path, "r", eta=1))
    assert _rows(out / "gains.json") == []
    assert len(_rows(out / "sweep.json")) == 1


# -- errors -------------------------------------------------------------------------------


def _error(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *runs: Path) -> str:
    with pytest.raises(SystemExit) as e:
        _script(name).main(["--out", str(tmp_path / "out"), "--runs", *map(str, runs)])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("script", ["sim_staleness", "sim_instance_load", "sim_eta_sweep"])
def test_a_folder_that_is_not_a_run_folder(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(script, tmp_path, capsys, tmp_path / "missing")
    assert "is not a folder" in err and "staleflow launch" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _error(script, tmp_path, capsys, empty)
    assert "metrics.jsonl and config.yaml missing" in err and "staleflow launch" in err


def test_a_parent_of_run_folders_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_folder(tmp_path / "results", "20250101-000000-eta1", eta=1)
    err = _error("sim_staleness", tmp_path, capsys, tmp_path / "results")
    assert "holds run folders such as" in err and "20250101-000000-eta1" in err


def test_missing_config_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_folder(tmp_path, "r", eta=1)
    (run / "config.yaml").unlink()
    err = _error("sim_eta_sweep", tmp_path, capsys, run)
    assert "config.yaml missing" in " ".join(err.split()) and "staleflow launch" in err


def test_a_malformed_metrics_line_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_folder(tmp_path, "r", eta=1, steps=3)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:40]  # cut in the middle
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    err = " ".join(_error("sim_staleness", tmp_path, capsys, run).split())
    assert "metrics.jsonl line 2: malformed metrics record" in err
    with pytest.raises(RunFolderError, match="line 2"):
        read_run_folder(run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/elapsed_s": "soon"}) + "\n")
    with pytest.raises(RunFolderError, match=r"line 1: .*'time/elapsed_s' is not a number"):
        read_run_folder(run)
    (run / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(RunFolderError, match=r"line 1: .*JSON object"):
        read_run_folder(run)


@pytest.mark.parametrize("script", ["sim_staleness", "sim_instance_load", "sim_eta_sweep"])
def test_a_run_without_steps(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_folder(tmp_path, "r", eta=1, steps=1, finished=False)
    (run / "metrics.jsonl").write_text("")
    err = " ".join(_error(script, tmp_path, capsys, run).split())
    assert "has no training step" in err and "metrics.jsonl" in err


def test_help_names_the_runs_option(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("sim_staleness", "sim_instance_load", "sim_eta_sweep"):
        with pytest.raises(SystemExit) as e:
            _script(name).main(["--help"])
        assert e.value.code == 0
        assert "--runs DIR" in capsys.readouterr().out


def test_runs_named_twice_or_alike(tmp_path: Path) -> None:
    a = run_folder(tmp_path / "first", "20250101-000000-eta1", eta=1, steps=2)
    b = run_folder(tmp_path / "second", "20250101-000000-eta1", eta=1, steps=3)
    out = _main("sim_staleness", tmp_path, a, a, b)
    runs = [r["run"] for r in _rows(out / "staleness.json")]
    assert runs == [f"first/{a.name}"] * 2 + [f"second/{b.name}"] * 3
