"""experiments/bench_speculation.py at a tiny size: every side samples the same tokens,
grouped drafts are accepted, and the figures are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.support.experiments import load


def test_the_sides_agree_and_the_figures_are_written(tmp_path: Path) -> None:
    bench = load("bench_speculation")
    out = tmp_path / "spec.json"
    args = ["--hidden", "32", "--layers", "1", "--vocab", "64", "--tokens", "16", "--group", "3"]
    sides = ["--sides", ",".join(bench.SIDES)]
    result = bench.main([*args, *sides, "--batches", "1,2", "--repeats", "1", "--json", str(out)])
    rows = {(r["batch"], r["side"]): r for r in result["rows"]}
    assert len(rows) == 2 * len(bench.SIDES)
    assert all(r["same_tokens_as_none"] for r in rows.values())
    assert rows[1, "none"]["verifications"] == 0
    assert rows[1, "group"]["accepted_per_verification"] > 0
    assert rows[1, "group-window"]["drafted"] <= rows[1, "group"]["drafted"]
    assert 0 < rows[1, "group"]["draft_share"] < 1
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))


def test_racing_the_draft_methods_samples_the_same_tokens_and_counts_steps() -> None:
    bench = load("bench_speculation")
    args = ["--hidden", "32", "--layers", "1", "--vocab", "64", "--tokens", "16", "--group", "3"]
    race = bench.main([*args, "--batches", "2", "--race-methods"])["race"]
    assert race["stragglers"] == 2
    # off verifies nothing: one token per step (the prefill's aside), the slowest
    assert race["steps"]["off"] == [15, 15]
    assert race["mean_steps"]["group"] <= race["mean_steps"]["off"]
    assert race["race_group_own_mean_steps"] <= race["mean_steps"]["group"]
    assert abs(sum(race["fastest_share"].values()) - 1) < 1e-9
