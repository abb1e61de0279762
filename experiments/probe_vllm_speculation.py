"""What vLLM's own speculative decoding does to StaleFlow's guarantees (issue 38).

Runs the same seeded requests through ``VLLMEngine`` twice, without and with vLLM's
model-free ``ngram`` speculation (``speculative_config``), on a tiny random Qwen2, and
reports per request whether the sampled tokens are the same (keyed sampling: a resumed
or raced trajectory must sample what one run straight through would) and how far the
recorded logprobs are from a full forward pass of the target model (the trainer's
importance ratios need the target's). Needs vLLM (CI's ``.venv-vllm``)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python experiments/probe_vllm_speculation.py \\
        --temperature 0.7 --json results/probe_vllm_speculation.json

docs/speculation.md ("vLLM") has the figures and what they mean for wiring it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from staleflow.engines.base import GenerationRequest
from staleflow.engines.vllm import VLLMEngine, VLLMEngineConfig

VOCAB = 48
MAX_SEQ = 96


def tiny_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        hidden_size=64,  # head_dim 32: vLLM's CPU attention needs a multiple of 32
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()


def forward_logprobs(
    model: transformers.PreTrainedModel, prompt: np.ndarray, tokens: np.ndarray, temperature: float
) -> np.ndarray:
    seq = torch.from_numpy(np.concatenate([prompt, tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    logp = torch.log_softmax(logits / max(temperature, 1e-6), -1)
    idx = torch.arange(len(tokens))
    return logp[len(prompt) - 1 + idx, torch.from_numpy(tokens.astype(np.int64))].numpy()


def requests(n: int, max_response: int) -> list[GenerationRequest]:
    out = []
    for i in range(n):
        if i % 2 == 0:  # a repeating prompt: n-gram drafts find matches
            prompt = np.array(([1, 2, 3, 4, 5] * 4)[: 12 + i], dtype=np.int32)
        else:
            prompt = np.random.default_rng(i).integers(0, VOCAB, 10, dtype=np.int32)
        empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        out.append(GenerationRequest(100 + i, prompt, empty_i, empty_f, empty_i, max_response))
    return out


def run(folder: Path, temperature: float, speculate: bool, n: int, max_response: int) -> Any:
    extra: dict[str, Any] = {}
    if speculate:
        extra["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    engine = VLLMEngine(
        VLLMEngineConfig(
            model_path=str(folder),
            kv_budget_tokens=2048,
            max_running=16,
            max_seq_len=MAX_SEQ,
            temperature=temperature,
            top_p=1.0,
            eos_token_id=None,
            seed=0,
            extra_args=extra,
        )
    )
    reqs = requests(n, max_response)
    engine.submit(reqs)
    outs = {}
    started = time.perf_counter()
    while engine.has_work:
        for o in engine.step():
            outs[o.traj_id] = o
    took = time.perf_counter() - started
    stats = engine._stats()  # vLLM's own counters, spec_decode_* among them
    engine.close()
    return reqs, outs, took, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-response", type=int, default=40)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    model = tiny_model()
    folder = Path(tempfile.mkdtemp()) / "model"
    model.save_pretrained(folder)
    reqs, plain, t_plain, _ = run(folder, args.temperature, False, args.requests, args.max_response)
    _, spec, t_spec, stats = run(folder, args.temperature, True, args.requests, args.max_response)
    rows = []
    for r in reqs:
        a, b = plain[r.traj_id], spec[r.traj_id]
        n = min(len(a.tokens), len(b.tokens))
        differ = np.flatnonzero(a.tokens[:n] != b.tokens[:n])
        rows.append(
            {
                "traj_id": r.traj_id,
                "same_tokens": bool(np.array_equal(a.tokens, b.tokens)),
                "first_difference": int(differ[0]) if len(differ) else None,
                "logprob_error_plain": float(
                    np.max(
                        np.abs(
                            a.logprobs
                            - forward_logprobs(model, r.prompt, a.tokens, args.temperature)
                        )
                    )
                ),
                "logprob_error_speculative": float(
                    np.nanmax(
                        np.abs(
                            b.logprobs
                            - forward_logprobs(model, r.prompt, b.tokens, args.temperature)
                        )
                    )
                ),
                "logprobs_not_finite": int(np.sum(~np.isfinite(b.logprobs))),
            }
        )
    spec_stats = {k: v for k, v in stats.items() if "spec_decode" in k}
    print(
        f"temperature {args.temperature}: decode {t_plain:.2f} s plain, {t_spec:.2f} s speculative"
    )
    print("vLLM counters:", spec_stats)
    for row in rows:
        print(row)
    same = sum(r["same_tokens"] for r in rows)
    print(f"same tokens in {same} of {len(rows)} requests")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"temperature": args.temperature, "counters": spec_stats, "rows": rows}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
