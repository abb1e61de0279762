"""The simulator's experiment scripts (experiments/sim_*.py) run on the ``tiny`` preset and
write sane CSV, JSON and PNG files; the timeline recorder and the scaling helper too."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from staleflow.sim import SimCluster, system, tiny
from staleflow.sim.report import seed_list, stats
from staleflow.sim.scaling import scale, value
from staleflow.sim.summary import staleness_per_buffer
from staleflow.sim.timeline import Timeline
from tests.support.experiments import load

pytest.importorskip("matplotlib")

SCRIPTS = (
    "sim_eta_sweep",
    "sim_ablation",
    "sim_instance_load",
    "sim_staleness",
    "sim_scaling",
    "sim_gap",
    "sim_bound",
)


def _script(name: str) -> ModuleType:
    return load(name)


def _rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(path.read_text())
    with path.with_suffix(".csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    return rows


def _run(name: str, tmp_path: Path, *args: str) -> Path:
    out = tmp_path / name
    assert _script(name).main(["--preset", "tiny", "--out", str(out), *args]) == 0
    return out


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    for name in SCRIPTS:
        with pytest.raises(SystemExit) as e:
            _script(name).main(["--help"])
        assert e.value.code == 0
        assert "--" in capsys.readouterr().out


def test_eta_sweep(tmp_path: Path) -> None:
    out = _run(
        "sim_eta_sweep",
        tmp_path,
        "--etas",
        "0,1",
        "--steps",
        "3",
        "--systems",
        "staleflow,vanilla,sync",
    )
    rows = _rows(out / "sweep.json")
    assert [(r["name"], r["eta"]) for r in rows] == [
        ("staleflow", 0),
        ("staleflow", 1),
        ("vanilla", 0),
        ("vanilla", 1),
        ("sync", 0),
    ]
    assert all(r["tokens_per_s"] > 0 and r["steps"] == 3 for r in rows)
    gains = _rows(out / "gains.json")
    assert {(g["baseline"], g["eta"]) for g in gains} == {
        ("vanilla", 0),
        ("vanilla", 1),
        ("sync", 0),
        ("sync", 1),
    }
    assert all(0.2 < g["gain"] < 10 for g in gains)
    assert (out / "eta_sweep.png").stat().st_size > 0


def test_ablation(tmp_path: Path) -> None:
    out = _run("sim_ablation", tmp_path, "--eta", "1", "--steps", "2")
    rows = _rows(out / "ablation.json")
    assert len(rows) == 8
    assert len({r["system"] for r in rows}) == 8
    assert rows[0]["system"] == "R0S0M0" and rows[0]["normalised"] == 1.0
    assert all(r["tokens_per_s"] > 0 and 0.2 < r["normalised"] < 5 for r in rows)
    assert (out / "ablation.png").stat().st_size > 0
    pairs, runs = _rows(out / "ablation_pairs.json"), _rows(out / "ablation_runs.json")
    assert [p["slot"] for p in pairs] == ["routing"] * 4 + ["sync"] * 4 + ["migration"] * 4
    tput = {r["system"]: r["tokens_per_s"] for r in runs}
    for p in pairs:
        assert p["gain"] == pytest.approx(tput[p["on"]] / tput[p["off"]])


def test_ablation_pairs_compare_each_slot_with_the_others_fixed() -> None:
    ablation = _script("sim_ablation")
    # Throughput doubles with routing, grows 10% with sync on seed 0 and falls 10% on
    # seed 1, and migration adds nothing, whatever the other slots are.
    runs = [
        {
            "system": combo,
            "seed": seed,
            "tokens_per_s": 100.0
            * (2.0 if combo[1] == "1" else 1.0)
            * ((1.1 if seed == 0 else 0.9) if combo[3] == "1" else 1.0),
        }
        for combo in ablation.COMBOS
        for seed in (0, 1)
    ]
    pairs = ablation.slot_pairs(runs)
    assert len(pairs) == 12
    sync = [p for p in pairs if p["slot"] == "sync"]
    assert [(p["off"], p["on"], p["with"]) for p in sync] == [
        ("R0S0M0", "R0S1M0", "R0M0"),
        ("R0S0M1", "R0S1M1", "R0M1"),
        ("R1S0M0", "R1S1M0", "R1M0"),
        ("R1S0M1", "R1S1M1", "R1M1"),
    ]
    assert all(
        p["gain"] == pytest.approx(1.0) and p["gain_min"] == pytest.approx(0.9) for p in sync
    )
    assert all(p["gain"] == pytest.approx(2.0) for p in pairs if p["slot"] == "routing")
    lines = ablation.pair_lines(pairs)
    assert lines[0].startswith("routing adds over its vanilla counterpart in 4 of 4 pairs")
    assert lines[2].startswith("migration adds over its vanilla counterpart in 0 of 4 pairs")
    # A combination missing a seed pairs only over the seeds both ran.
    partial = ablation.slot_pairs([r for r in runs if (r["system"], r["seed"]) != ("R1S1M1", 1)])
    last = [p for p in partial if p["on"] == "R1S1M1"]
    assert [p["seeds"] for p in last] == [1, 1, 1]
    assert all(p["gain"] == pytest.approx(p["gain_min"]) for p in last)


def test_staleness(tmp_path: Path) -> None:
    out = _run("sim_staleness", tmp_path, "--eta", "2", "--steps", "6")
    rows = _rows(out / "staleness.json")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert 0 <= r["max_staleness"] <= 2
        assert r["groups"] == sum(r[f"staleness_{k}"] for k in range(3)) == 4
    assert (out / "staleness.png").stat().st_size > 0


def test_instance_load(tmp_path: Path) -> None:
    out = _run("sim_instance_load", tmp_path, "--eta", "1", "--steps", "3")
    loads, syncs = _rows(out / "instance_load.json"), _rows(out / "syncs.json")
    assert {r["system"] for r in loads} == {"staleflow", "vanilla"}
    assert {r["inst"] for r in loads} == {0, 1, 2, 3}
    assert all(r["running"] >= 0 and r["tokens_per_s"] >= 0 for r in loads)
    assert syncs and all(s["version"] >= 1 for s in syncs)
    assert (out / "instance_load.png").stat().st_size > 0


def test_scaling(tmp_path: Path) -> None:
    out = _run("sim_scaling", tmp_path, "--eta", "1", "--steps", "2")
    rows = _rows(out / "scaling.json")
    assert len(rows) == 3 * 3 * 2
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["relative_to_vanilla"] == 1.0 for r in rows if r["system"] == "vanilla")
    assert (out / "scaling.png").stat().st_size > 0


def test_scaling_script_one_dimension(tmp_path: Path) -> None:
    out = _run(
        "sim_scaling",
        tmp_path,
        "--eta",
        "1",
        "--steps",
        "2",
        "--dimensions",
        "gpus",
        "--factors",
        "1,2",
    )
    rows = _rows(out / "scaling.json")
    assert [(r["value"], r["system"]) for r in rows] == [
        (8, "staleflow"),
        (8, "vanilla"),
        (16, "staleflow"),
        (16, "vanilla"),
    ]


def test_scale() -> None:
    base = tiny()
    assert value(scale(base, "response", 2), "response") == 2 * base.workload.max_response
    assert value(scale(base, "batch", 0.5), "batch") == base.batch_size // 2
    big = scale(base, "gpus", 2)
    assert big.instances == 2 * base.instances
    assert big.trainer.seconds_per_token == pytest.approx(base.trainer.seconds_per_token / 2)
    with pytest.raises(ValueError):
        scale(base, "nodes", 2)


def test_timeline_records_every_cycle_and_every_pull() -> None:
    cluster = SimCluster(system("vanilla", tiny(eta=1, steps=3)))
    timeline = Timeline().attach(cluster)
    summary = cluster.run()
    n = len(cluster.instances)
    assert len(timeline.samples) == summary.cycles * n
    # Greedy (vanilla) sync pulls every instance to every new version it reaches.
    final = {i.inst_id: i.version for i in cluster.instances.values()}
    assert len(timeline.syncs) == sum(final.values())
    assert all(s.kv_tokens >= 0 and s.waiting >= 0 for s in timeline.samples)


def test_timeline_sampling_interval_keeps_every_pull() -> None:
    dense, sparse = Timeline(), Timeline(every_s=5.0)
    cluster = SimCluster(tiny(eta=1, steps=3))
    dense.attach(cluster)
    sparse.attach(cluster)
    cluster.run()
    assert len(sparse.samples) < len(dense.samples)
    assert sparse.syncs == dense.syncs
    times = sorted({s.time for s in sparse.samples})
    assert all(b - a >= 5.0 - 1e-9 for a, b in itertools.pairwise(times))


def test_staleness_per_buffer_matches_summary() -> None:
    cluster = SimCluster(tiny(eta=2, steps=5))
    summary = cluster.run()
    per_buffer = staleness_per_buffer(cluster)
    assert len(per_buffer) == summary.steps
    total: dict[int, int] = {}
    for _, hist in per_buffer:
        for k, v in hist.items():
            total[k] = total.get(k, 0) + v
    assert total == summary.staleness


def test_eta_sweep_over_seeds(tmp_path: Path) -> None:
    out = _run(
        "sim_eta_sweep",
        tmp_path,
        "--etas",
        "1",
        "--steps",
        "3",
        "--systems",
        "staleflow,vanilla,sync",
        "--seeds",
        "0,2",
    )
    rows = _rows(out / "sweep.json")
    assert [(r["name"], r["seed"]) for r in rows] == [
        ("staleflow", 0),
        ("staleflow", 2),
        ("vanilla", 0),
        ("vanilla", 2),
        ("sync", 0),
        ("sync", 2),
    ]
    summary = {(r["name"], r["eta"]): r for r in _rows(out / "sweep_stats.json")}
    mine = summary["staleflow", 1]
    assert mine["seeds"] == [0, 2]
    values = [r["tokens_per_s"] for r in rows if r["name"] == "staleflow"]
    assert mine["tokens_per_s_mean"] == pytest.approx(sum(values) / 2)
    assert mine["tokens_per_s_min"] == min(values) and mine["tokens_per_s_max"] == max(values)
    gains = {g["baseline"]: g for g in _rows(out / "gains.json")}
    # The gain is the mean of per-seed ratios (same seed, same workload draws).
    ratios = [
        a["tokens_per_s"] / b["tokens_per_s"]
        for a in rows
        if a["name"] == "staleflow"
        for b in rows
        if b["name"] == "vanilla" and b["seed"] == a["seed"]
    ]
    assert gains["vanilla"]["gain"] == pytest.approx(sum(ratios) / 2)
    assert gains["vanilla"]["gain_min"] == pytest.approx(min(ratios))
    assert gains["vanilla"]["seeds"] == [0, 2] and gains["sync"]["seeds"] == [0, 2]


def test_ablation_over_seeds(tmp_path: Path) -> None:
    out = _run("sim_ablation", tmp_path, "--eta", "1", "--steps", "2", "--seeds", "2")
    rows, runs = _rows(out / "ablation.json"), _rows(out / "ablation_runs.json")
    assert len(rows) == 8 and len(runs) == 16
    assert all(r["seeds"] == [0, 1] for r in rows)
    assert rows[0]["system"] == "R0S0M0" and rows[0]["normalised"] == 1.0
    for row in rows:
        mine = [r["tokens_per_s"] for r in runs if r["system"] == row["system"]]
        assert row["tokens_per_s"] == pytest.approx(sum(mine) / 2)
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]


def test_gap_window_and_tail(tmp_path: Path) -> None:
    out = tmp_path / "gap"
    args = ["--out", str(out), "--sections", "window,tail", "--eta", "1", "--steps", "3"]
    assert _script("sim_gap").main([*args, "--max-response", "1000"]) == 0
    window = _rows(out / "gap_window.json")
    assert {r["system"] for r in window} == {"staleflow", "vanilla"}
    for r in window:
        assert r["ts_admissible"] <= r["ts_initial"] and 0.0 <= r["kv_used"] <= 1.0
    tail = {r["statistic"]: r["ours"] for r in _rows(out / "gap_tail.json")}
    assert 0.0 < tail["trajectories at the cap"] < 0.2
    assert 0.8 < tail["log-length intra-group correlation"] < 1.0


def test_bound_caps_every_run_and_says_which_targets_are_out_of_reach(tmp_path: Path) -> None:
    """sim_bound's best split at the two sides' measured rates: no run (StaleFlow at any of
    the splits, sticky, sync) trains faster after its warm-up, and a target above the cap
    is called out of reach."""
    out = tmp_path / "bound.json"
    args = ["--small", "--workload", "preset-20k", "--rollout-bound", "1", "2"]
    args += ["--trainer-bound", "7", "--compare", "sticky:3", "sync"]
    assert (
        _script("sim_bound").main([*args, "--targets", "sticky:1.3", "sync:50", "--json", str(out)])
        == 0
    )
    figures = json.loads(out.read_text())
    assert not figures["problems"]
    rates = figures["rates"]
    assert 0 < rates["rho_as_run"] <= rates["rho_decoding"] and rates["tau"] > 0
    assert figures["bound_as_run"] <= figures["bound_decoding"]
    assert len(figures["runs"]) == 5
    for run in figures["runs"]:
        assert run["steady_tokens_per_s"] <= figures["bound_decoding"]
    verdicts = {v["system"]: v for v in figures["targets"]}
    assert verdicts["sticky"]["verdict"] == "within reach"
    assert verdicts["sync"]["verdict"] == "out of reach"
    assert verdicts["sync"]["cap_decoding"] < 50


def test_bound_refuses_a_split_where_its_side_does_not_bind(tmp_path: Path) -> None:
    out = tmp_path / "bound.json"
    args = ["--small", "--workload", "preset-20k", "--rollout-bound", "1"]
    assert _script("sim_bound").main([*args, "--trainer-bound", "6", "--json", str(out)]) == 1
    problems = json.loads(out.read_text())["problems"]
    assert len(problems) == 1 and "not trainer-bound" in problems[0]
    with pytest.raises(SystemExit, match="no --compare run of vanilla"):  # before any run
        _script("sim_bound").main([*args, "--compare", "sync", "--targets", "vanilla:2"])


def test_seed_list_and_stats() -> None:
    assert seed_list("3") == [0, 1, 2]
    assert seed_list("3", first=5) == [5, 6, 7]
    assert seed_list("0,4") == [0, 4] and seed_list("4,") == [4]
    for bad in ("0", "x", "1,1", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)
    s = stats([1.0, 2.0, 3.0])
    assert s == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    assert stats([5.0])["std"] == 0.0
