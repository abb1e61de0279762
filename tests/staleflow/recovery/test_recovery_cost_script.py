"""``experiments/recovery_cost.py`` runs (one kill per interval, short responses) and
writes what a killed rollout instance cost: never more than what was in flight on it,
all of it without progress reports, less with them (the TS kept what was reported)."""

from __future__ import annotations

import json

import pytest

from tests.support.experiments import load

pytest.importorskip("torch")


def test_the_script_measures_tokens_regenerated_per_kill(tmp_path, capsys):
    module = load("recovery_cost")
    out = tmp_path / "cost.json"
    args = ["--progress", "0,0.1", "--rounds", "1", "--response-tokens", "48", "--json", str(out)]
    assert module.main(args) == 0
    assert "regenerated" in capsys.readouterr().out
    data = json.loads(out.read_text())
    never, often = data["summary"]
    assert never["tokens_in_flight"] > 0 and never["regenerated_share"] == 1.0
    for row in data["rows"]:
        assert 0 <= row["tokens_regenerated"] <= row["tokens_in_flight"], row
    (reported,) = [r for r in data["rows"] if r["progress_s"] == 0.1]
    assert reported["reports"] > 0
    assert often["tokens_regenerated"] < never["tokens_regenerated"]
