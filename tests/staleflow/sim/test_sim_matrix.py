"""The experiment matrix (experiments/sim_matrix.py) at the tiny scale: its phases, its
tables, its verdicts and the independent staleness audit they rest on."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from staleflow.sim import SimCluster, system
from staleflow.sim.audit import StalenessAudit
from staleflow.sim.presets import WORKLOADS
from tests.support.experiments import load


def _matrix() -> ModuleType:
    return load("sim_matrix")


def test_the_matrix_runs_audits_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = _matrix()
    args = [
        "--small",
        "--workloads",
        "preset-20k,hetero-0.2",
        "--etas",
        "1,3",
        "--seeds",
        "2",
        "--steps",
        "6",
        "--splits",
        "0.375,0.5",
        "--out",
        str(tmp_path),
        "--json",
        str(tmp_path / "all.json"),
    ]
    assert m.main(args) == 0
    out = json.loads((tmp_path / "all.json").read_text())
    runs, cells = out["runs"], out["cells"]
    # split search: 2 splits x 4 systems with a split x 2 workloads; then every cell
    assert {(r["workload"], r["system"]) for r in runs} == {
        (w, s) for w in ("preset-20k", "hetero-0.2") for s in m.SYSTEMS
    }
    for r in runs:
        assert r["audit_max_staleness"] <= r["audit_max_staleness_oldest_token"] <= r["eta"]
        assert r["audit_trajectories"] > 0 and r["conservation_problems"] == 0
    # pipeline and sync keep their own bound and are compared at every eta
    assert {r["eta"] for r in runs if r["system"] == "sync"} == {0}
    assert {(c["eta"], c["baseline"]) for c in cells if c["workload"] == "preset-20k"} == {
        (e, b) for e in (1, 3) for b in ("sticky", "vanilla", "pipeline", "sync")
    }
    for c in cells:
        assert c["seeds"] == 2 and c["ratio_min"] <= c["ratio"] <= c["ratio_max"]
    # each system's best split per workload and eta: the cell runs at what was chosen
    chosen = {(s["workload"], s["system"], s["eta"]): s["rollout_gpus"] for s in out["splits"]}
    assert set(chosen) == {
        (w, s, e)
        for w in ("preset-20k", "hetero-0.2")
        for s in ("staleflow", "sticky", "vanilla", "pipeline")
        for e in ((1,) if s == "pipeline" else (1, 3))
    }
    for s in out["splits"]:
        assert len(s["tried"]) == 2 and s["tried"][str(s["rollout_gpus"])] == max(
            s["tried"].values()
        )
    for r in runs:
        if r["system"] != "sync":
            assert r["rollout_gpus"] == chosen[r["workload"], r["system"], r["eta"]]
    for c in cells:
        mine = chosen[c["workload"], "staleflow", c["eta"]]
        assert c["staleflow_rollout_gpus"] == [mine]
    assert len(out["verdicts"]) >= 3 and all(
        v.startswith(("verdict", "warning")) for v in out["verdicts"]
    )
    printed = capsys.readouterr().out
    assert "StaleFlow / baseline per cell" in printed and "verdict: max staleness" in printed
    # an interrupted matrix resumes from its journal without running anything again
    lines = (tmp_path / "matrix_runs.jsonl").read_text().splitlines()
    assert len(lines) == len({json.dumps(json.loads(x)["run"]) for x in lines})
    assert m.main([*args, "--resume"]) == 0
    assert (tmp_path / "matrix_runs.jsonl").read_text().splitlines() == lines


def test_one_split_eta_keeps_its_split_for_every_eta(tmp_path: Path) -> None:
    m = _matrix()
    args = ["--small", "--workloads", "preset-20k", "--etas", "1,3", "--seeds", "1"]
    args += ["--steps", "5", "--split-eta", "3", "--systems", "staleflow,sticky"]
    assert m.main([*args, "--out", str(tmp_path), "--json", str(tmp_path / "a.json")]) == 0
    out = json.loads((tmp_path / "a.json").read_text())
    assert [(s["system"], s["eta"]) for s in out["splits"]] == [("staleflow", 3), ("sticky", 3)]
    for s in out["splits"]:
        assert {r["rollout_gpus"] for r in out["runs"] if r["system"] == s["system"]} == {
            s["rollout_gpus"]
        }


def test_the_split_search_over_seeds_keeps_the_best_mean(tmp_path: Path) -> None:
    m = _matrix()
    args = ["--small", "--workloads", "hetero-0.2", "--etas", "3", "--seeds", "2"]
    args += ["--steps", "5", "--systems", "staleflow,sticky", "--search-seeds", "2"]
    assert m.main([*args, "--out", str(tmp_path), "--json", str(tmp_path / "a.json")]) == 0
    out = json.loads((tmp_path / "a.json").read_text())
    journal = [
        json.loads(x)["row"] for x in (tmp_path / "matrix_runs.jsonl").read_text().splitlines()
    ]
    for s in out["splits"]:
        runs = [r for r in journal if r["system"] == s["system"]]
        # every split on both seeds, and nothing run twice: the cells reuse the search
        assert sorted((r["rollout_gpus"], r["seed"]) for r in runs) == [
            (g, seed) for g in sorted(int(k) for k in s["tried"]) for seed in (0, 1)
        ]
        means = {
            g: float(np.mean([r["tokens_per_s"] for r in runs if r["rollout_gpus"] == g]))
            for g in {r["rollout_gpus"] for r in runs}
        }
        assert s["tried"] == {str(g): round(v, 1) for g, v in means.items()}
        assert s["rollout_gpus"] == max(means, key=lambda g: means[g])
    with pytest.raises(SystemExit):
        m.main([*args[:-1], "3", "--out", str(tmp_path / "bad")])


def test_the_same_split_verdict_pairs_runs_of_one_split_and_seed() -> None:
    m = _matrix()

    def row(system: str, tok: float, seed: int = 0, gpus: int = 48) -> dict[str, Any]:
        return {"workload": "w", "eta": 3, "seed": seed, "rollout_gpus": gpus, "steps": 11,
                "system": system, "tokens_per_s": tok}  # fmt: skip

    rows = [row("staleflow", 100.0), row("sticky", 99.0), row("vanilla", 101.0)]
    rows += [row("staleflow", 90.0, seed=1), row("sticky", 100.0, seed=1)]
    rows += [row("vanilla", 50.0, gpus=64), row("pipeline", 200.0)]  # no pair: not counted
    line = m.same_split_line(rows)
    assert line is not None and "3 pairs, worst 0.900 (w eta=3 seed=1 48" in line
    assert line.endswith("vs sticky): FAIL (1 below)")
    assert m.same_split_line(rows[:3]).endswith(": PASS")
    assert m.same_split_line([row("staleflow", 1.0)]) is None


def test_verdicts_name_what_fails() -> None:
    m = _matrix()
    row = {
        "workload": "hetero-0.2",
        "system": "staleflow",
        "eta": 3,
        "seed": 0,
        "audit_max_staleness": 4,
        "audit_max_staleness_oldest_token": 4,
        "audit_older_later_tokens": 0,
        "stalled": False,
        "conservation_problems": 0,
    }
    cells = [
        {
            "workload": "hetero-0.2",
            "eta": 3,
            "baseline": "sticky",
            "ratio": 1.1,
            "ratio_min": 0.97,
            "ratio_text": "1.100 [0.970..1.2]",
        },
        {
            "workload": "hetero-0.2",
            "eta": 1,
            "baseline": "sticky",
            "ratio": 1.2,
            "ratio_min": 1.1,
            "ratio_text": "1.2",
        },
    ]
    lines = m.verdict_lines([row], cells, ["hetero-0.2"], [1, 3])
    assert "FAIL in hetero-0.2 eta=3 vs sticky" in lines[0]  # a seed below 0.98
    assert "1.100x" in lines[1] and lines[1].endswith("FAIL")  # below 1.2
    assert "growing from eta=1 to eta=5: FAIL" in lines[2]  # 1.2 then 1.1
    assert "FAIL in hetero-0.2 staleflow eta=3 seed=0: 4" in lines[3]  # staleness 4 > 3


def test_the_audit_sees_what_the_trainer_received() -> None:
    config = system("staleflow", WORKLOADS["preset-20k"].config(2, steps=6, small=True))
    cluster = SimCluster(config)
    audit = StalenessAudit().attach(cluster)
    cluster.run()
    assert audit.batches == cluster.trainer.steps or audit.batches == cluster.trainer.steps + 1
    assert 0 < audit.max_staleness <= audit.max_staleness_oldest_token <= 2
    assert audit.trajectories >= cluster.trainer.steps * config.batch_size * config.group_size


def test_the_audit_measures_against_the_first_and_the_oldest_token() -> None:
    class Traj:
        def __init__(self, traj_id: int, versions: list[int]) -> None:
            self.traj_id, self.versions = traj_id, np.array(versions, np.int32)

    class Batch:
        def __init__(self, trajs: list[Traj]) -> None:
            self.groups = [type("G", (), {"trajectories": trajs})()]

    audit = StalenessAudit()
    audit._record(7, Batch([Traj(1, [3, 3, 4]), Traj(2, [5, 4])]))
    assert audit.max_staleness == 4  # 7 - 3, against the first token
    assert audit.max_staleness_oldest_token == 4  # trajectory 2: 7 - 4 (its first is 5)
    audit._record(7, Batch([Traj(3, [4, 2])]))
    assert (audit.max_staleness, audit.max_staleness_oldest_token) == (4, 5)
    assert len(audit.older_later_tokens) == 2 and "trajectory 2" in audit.older_later_tokens[0]
    assert audit.trajectories == 3


def test_workloads_are_defined_before_any_run() -> None:
    skewed = {name for name, w in WORKLOADS.items() if w.skewed}
    assert skewed == {
        "heavy-tail", "bimodal", "hetero-0.1", "hetero-0.2", "outliers",
        "search-agent", "swe-agent",  # skewed by their turns and tool waits (issue 35)
    }  # fmt: skip
    cfg: Any = WORKLOADS["gpus-512"].config(3, steps=4)
    assert cfg.instances == 256
    assert WORKLOADS["gpus-512"].config(3, steps=4, rollout_gpus=192).instances == 192
    with pytest.raises(ValueError, match="rollout_gpus"):
        WORKLOADS["preset-20k"].config(3, steps=4, rollout_gpus=128)


def test_freshness_adds_the_rule_at_staleflows_split_and_compares_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--freshness``: staleflow+fresh runs at StaleFlow's split and seeds, and the
    comparison names each cell's throughput ratio, both mean stalenesses and the
    verdicts of issue 36."""
    out = tmp_path / "m.json"
    args = ["--small", "--workloads", "preset-20k", "--etas", "3", "--systems", "staleflow"]
    args += ["--seeds", "1", "--splits", "0.5", "--steps", "6", "--freshness"]
    assert _matrix().main([*args, "--out", str(tmp_path / "o"), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = {(r["system"], r["rollout_gpus"]) for r in data["runs"]}
    assert {s for s, _ in runs} == {"staleflow", "staleflow+fresh"}
    assert len({g for _, g in runs}) == 1  # the same split
    (cell,) = data["freshness"]
    assert cell["seeds"] == 1 and cell["ratio"] > 0
    assert 0 <= cell["staleness_on"] <= 3 and 0 <= cell["staleness_off"] <= 3
    assert sum("freshness on >= 0.98x" in v for v in data["verdicts"]) == 1
    assert "Freshness off | on" in capsys.readouterr().out


@pytest.mark.parametrize("stream", ["staleflow", "all"])
def test_stream_trains_streamed_in_the_systems_it_names(tmp_path: Path, stream: str) -> None:
    """``--stream staleflow``: StaleFlow's runs (its split search's included) train
    streamed and the baselines as they run; ``all``: every system but sync, which has no
    idle trainer to stream into. Rows say which, and a streamed run did stream."""
    out = tmp_path / "m.json"
    args = ["--small", "--workloads", "preset-20k", "--etas", "3", "--seeds", "1"]
    args += ["--systems", "staleflow,sticky,sync", "--splits", "0.5", "--steps", "5"]
    args += ["--stream", stream, "--out", str(tmp_path / "o"), "--json", str(out)]
    assert _matrix().main(args) == 0
    runs = json.loads(out.read_text())["runs"]
    streamed = {r["system"]: r["stream"] for r in runs}
    assert streamed == {"staleflow": True, "sticky": stream == "all", "sync": False}
    on = next(r for r in runs if r["system"] == "staleflow")
    off = _matrix().simulate(
        _matrix().Run("preset-20k", "staleflow", 3, 0, 5, on["rollout_gpus"], True)
    )
    assert on["tokens_per_s"] != off["tokens_per_s"] and off["stream"] is False


def test_freshness_verdicts_name_slow_and_stale_cells_and_spare_the_floor() -> None:
    from staleflow.sim.freshness import freshness_verdicts

    def cell(
        w: str, eta: int, ratio: float, off: float, on: float, binds: bool, wait: float = 2.0
    ) -> dict:
        return {
            "workload": w,
            "eta": eta,
            "ratio": ratio,
            "ratio_text": f"{ratio:.3f}",
            "staleness_off": off,
            "staleness_on": on,
            "trainer_binds": binds,
            "ready_wait_off": wait,
        }

    good = [
        cell("a", 3, 0.99, 2.8, 2.1, True),
        cell("a", 1, 1.0, 0.97, 0.97, True),  # at the floor: nothing fresher without waiting
        cell("b", 3, 1.0, 2.8, 2.8, False),  # the rollout binds: the rule gives way
    ]
    fast, fresh = freshness_verdicts(good)
    assert fast.endswith("3 cells, PASS")
    assert fresh.endswith("2 cells, 1 of them at that floor, PASS")
    fast, fresh = freshness_verdicts([*good, cell("c", 3, 0.97, 2.81, 2.81, True)])
    assert fast.endswith("FAIL in c eta=3 0.970")
    assert fresh.endswith("FAIL in c eta=3 2.81 -> 2.81")
    # batches that waited no longer than the step before them once complete: nothing to
    # take off, so the same staleness is that floor, not a failure; a journal from before
    # the wait was measured (None) gets no such allowance
    _, fresh = freshness_verdicts([*good, cell("d", 3, 1.0, 2.81, 2.81, True, wait=1.12)])
    assert fresh.endswith("3 cells, 2 of them at that floor, PASS")
    _, fresh = freshness_verdicts([*good, cell("d", 3, 1.0, 2.81, 2.81, True, wait=None)])
    assert fresh.endswith("FAIL in d eta=3 2.81 -> 2.81")
