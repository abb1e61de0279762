"""experiments/sim_seeds.py (issue #18's ablation) on the small shapes: every variant runs
on the same seeds as ``off``, the gain is per seed against ``off``, Seer's and
RolloutPipe's and the tail race's counters reach the rows, and --json holds the rows, the runs and the
switches."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.experiments import load


def _script() -> ModuleType:
    return load("sim_seeds")


def test_off_and_on_side_by_side_over_seeds(tmp_path: Path) -> None:
    args = ["--small", "--workloads", "bimodal", "--etas", "0,1", "--seeds", "2"]
    args += ["--steps", "2", "--chunk-tokens", "150", "--out", str(tmp_path)]
    assert _script().main([*args, "--json", str(tmp_path / "s.json")]) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data["meta"]["switches"]) >= {"seer", "kvpool", "stream", "race"}
    runs, rows = data["runs"], data["rows"]
    assert len(runs) == 2 * 7 * 2 and len(rows) == 2 * 7  # etas x variants (x seeds)
    off = {(r["eta"], r["seed"]): r["tokens_per_s"] for r in runs if r["variant"] == "off"}
    for r in runs:
        assert not r["stalled"] and r["steps"] == 2
        assert r["gain"] == pytest.approx(r["tokens_per_s"] / off[r["eta"], r["seed"]])
        assert r["rollout_to_train_end_s"] > 0 and 0 <= r["train_wait_ratio"] <= 1
        if r["variant"] == "off":
            assert r["chunks"] == 0 and r["probe_error"] == 0.0
        if "stream" not in r["variant"]:
            assert r["streamed_groups"] == r["streamed_tokens"] == 0
        if "race" not in r["variant"]:
            assert r["races_started"] == r["races_won"] == r["race_wasted_tokens"] == 0
    seer = [r for r in runs if r["variant"] == "seer"]
    assert sum(r["chunks"] for r in seer) > 0 and all(r["probe_error"] >= 0 for r in seer)
    pooled = [r for r in runs if r["variant"] == "seer+kvpool"]
    # the pool spares the re-prefill of chunks (preemptions still re-prefill)
    assert sum(r["reprefill_tokens"] for r in pooled) < sum(r["reprefill_tokens"] for r in seer)
    for variant in ("stream", "seer+stream"):
        streamed = [r for r in runs if r["variant"] == variant]
        assert all(r["streamed_groups"] > 0 and r["streamed_tokens"] > 0 for r in streamed)
    raced = [r for r in runs if r["variant"] in ("race", "race+stream")]
    assert sum(r["races_started"] for r in raced) > 0
    assert all(r["races_won"] <= r["races_started"] for r in raced)
    for row in rows:
        assert row["seeds"] == [0, 1] and "tokens_per_s_std" in row and "tail_s_max" in row
        assert "streamed_groups_std" in row and "rollout_to_train_end_s_max" in row
        assert "races_started_std" in row and "race_wasted_tokens_max" in row


def test_bad_options_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _script().main(["--workloads", "nope"])
    assert "--workloads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _script().main(["--variants", "rolloutpipe"])
    assert "--variants" in capsys.readouterr().err
