"""experiments/bench_sibling_fetch.py at a tiny size: the first fetch sends every response
whole, the next only what grew, and a fetch with nothing new sends no token."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.experiments import load


def test_only_new_tokens_travel_and_the_figures_are_written(tmp_path: Path) -> None:
    bench = load("bench_sibling_fetch")
    out = tmp_path / "fetch.json"
    args = ["--groups", "3", "--group-size", "2", "--tokens", "10", "--grow", "4"]
    result = bench.main([*args, "--repeats", "1", "--json", str(out)])
    first, grown, idle = result["rows"]
    assert (first["pieces"], first["tokens"]) == (6, 60)
    assert (grown["pieces"], grown["tokens"]) == (6, 24)
    assert (idle["pieces"], idle["tokens"]) == (0, 0)
    assert idle["reply_bytes"] < grown["reply_bytes"] < first["reply_bytes"]
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
