"""experiments/sim_rampup.py on a workload's shape at the tiny scale: the per-step record
it prints (waits, starts, batch sizes) agrees with itself and with the run's throughput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.experiments import load


def test_the_step_record_is_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = 4
    argv = ["--workload", "heavy-tail", "--small", "--eta", "1", "--steps", str(steps)]
    argv += ["--systems", "staleflow,sticky", "--seeds", "0,", "--out", str(tmp_path)]
    assert load("sim_rampup").main(argv) == 0
    rows = json.loads((tmp_path / "rampup.json").read_text())
    assert sorted(r["system"] for r in rows) == ["staleflow", "sticky"]
    out = capsys.readouterr().out
    for r in rows:
        starts, waits, batches = r["starts_s"], r["waits_s"], r["batch_tokens"]
        # one batch per finished step; a step may have started as the run stopped
        assert len(batches) == steps and len(starts) == len(waits) >= steps
        assert all(n > 0 for n in batches)
        # throughput is the batches' tokens over the time to the last step's end
        assert sum(batches) == pytest.approx(r["tokens_per_s"] * r["seconds"], rel=1e-9)
        assert starts[0] == waits[0]
        for i in range(1, len(starts)):
            # a step starts after the previous one has run and the trainer has waited
            assert starts[i] - starts[i - 1] >= waits[i] - 1  # each rounded to the second
        assert sum(waits[:2]) == pytest.approx(r["warmup_waits_s"], abs=2)
        assert f"{r['system']} seed=0: steps start at {starts}" in out
        assert f"{r['system']} seed=0: batches (M tokens) [" in out
