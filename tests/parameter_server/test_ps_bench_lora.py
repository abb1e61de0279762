"""``experiments/bench_lora_versions.py``: the layouts it measures are a run's (the
adapter's matrices on every target of every layer, the base under the model's own
names), and at Qwen2-0.5B, rank 16, an adapter version is at least 50x fewer bytes
than a full-weight one. The Pulls it times run once at a small size (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from tests.support.experiments import load

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def test_at_qwen2_05b_rank_16_adapter_versions_are_50x_smaller():
    bench = load("bench_lora_versions")
    found = bench.layouts("qwen2-0.5b", 16, TARGETS)
    c = bench.MODELS["qwen2-0.5b"]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    # r x (in + out) per target: q, o (h->h), k, v (h->kv), gate, up (h->inter), down
    per_layer = 16 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    assert sum(s.numel for s in found["adapter"]) == layers * per_layer
    assert sum(s.numel for s in found["full"]) == 494_032_768  # Qwen2-0.5B, tied embeddings
    assert found["base"].names == found["full"].names  # the base: the model's own weights
    assert found["full"].nbytes / found["adapter"].nbytes >= 50


@pytest.mark.slow
def test_the_bench_pulls_both_and_writes_verified_json(tmp_path):
    # a script run: its reader process is spawned from the script's own file
    out = tmp_path / "lora.json"
    args = ["--model", "tiny", "--repeats", "1", "--transports", "shm", "--json", str(out)]
    script = Path(__file__).resolve().parents[2] / "experiments" / "bench_lora_versions.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fewer bytes than full weights" in done.stdout
    result = json.loads(out.read_text())
    assert result["ratio"] > 1
    assert (
        result["full"]["pull"]["shm"]["verified"] and result["adapter"]["pull"]["shm"]["verified"]
    )
    assert result["adapter"]["pull"]["shm"]["base_once_s"] > 0
