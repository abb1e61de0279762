"""Decode throughput of the rollout engines against ``transformers``' ``generate()``, and
the Pull time (parameter server -> engine weights) of each engine.

The embedded CPU engine, vLLM (when ``vllm`` imports: run this in the vLLM environment,
see docs/engines.md) and HF ``generate()`` run the same randomly initialised Qwen2 model
(built from code, saved to a temporary folder for vLLM, nothing downloaded) on the same
batch of prompts, sampling at the same temperature / top-p, and decode the same number of
tokens per sequence (EOS disabled for the engines; ``min_new_tokens`` =
``max_new_tokens`` for HF). Figures are generated tokens per second:

* end to end: all new tokens / wall time including the prefill of the prompts;
* decode: tokens after the first / time after the first token. For an engine this is its
  own ``times().decode_s`` minus the first step; for HF it is the difference between a
  ``max_new_tokens=N`` and a ``max_new_tokens=1`` run.

Each figure is the median over ``--repeats`` runs; runs alternate between the sides so
load from other processes hits all alike. Everything runs one torch thread by default: on
a machine shared with other busy processes, OpenMP threads competing for cores stall each
other's parallel regions and multi-thread figures collapse into noise (the load average is
recorded for that reason); ``--threads 0`` keeps torch's default on a quiet machine.

Pull: a PS worker process holds the weights; one Pull copies them into a reusable buffer
over shared memory (``ps_fetch_s``), then the engine loads them (``load_s``: an in-place
copy for the embedded engine; ``reload_weights`` in the worker plus a prefix-cache reset
for vLLM). SGLang cannot run here, so it has no figures.

    python experiments/bench_engine.py --json results/bench_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from staleflow.engines.base import GenerationRequest
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

try:
    import vllm  # noqa: F401  (only to know whether the vLLM side runs)

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--intermediate", type=int, default=688, help="MLP size (default 688)")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    p.add_argument("--batch", type=int, default=64, help="sequences decoded together (default 64)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side (default 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, reproducible on a shared machine; 0: torch's default)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights, prompts, sampling")
    p.add_argument("--pulls", type=int, default=3, help="timed Pulls per engine (default 3)")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM even where it imports")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(args.seed)
    cfg = transformers.Qwen2Config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.new_tokens,
        tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()


def settings(prompts: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    batch, plen = prompts.shape
    seq = plen + args.new_tokens
    return {
        "kv_budget_tokens": batch * (seq + 1),
        "max_running": batch,
        "max_seq_len": seq,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "eos_token_id": None,
        "seed": args.seed,
    }


def embedded(model: torch.nn.Module, prompts: np.ndarray, args: argparse.Namespace) -> Any:
    return EmbeddedEngine(model, EmbeddedEngineConfig(**settings(prompts, args)))


def start_vllm(folder: Path, prompts: np.ndarray, args: argparse.Namespace) -> tuple[Any, float]:
    from staleflow.engines.vllm import VLLMEngine, VLLMEngineConfig

    t0 = time.perf_counter()
    engine = VLLMEngine(VLLMEngineConfig(model_path=str(folder), **settings(prompts, args)))
    return engine, time.perf_counter() - t0


def run_engine(engine: Any, prompts: np.ndarray, args: argparse.Namespace) -> dict:
    batch = prompts.shape[0]
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    engine.submit(
        [
            GenerationRequest(i, prompts[i], empty_i, empty_f, empty_i, args.new_tokens)
            for i in range(batch)
        ]
    )
    before = engine.times()
    t0 = time.perf_counter()
    outputs = list(engine.step())  # prefill + the first token (vLLM may split the prefill)
    while engine.has_work and engine.times().decode_tokens < before.decode_tokens + batch:
        outputs.extend(engine.step())
    first = time.perf_counter()
    decode_first = engine.times().decode_s
    while engine.has_work:
        outputs.extend(engine.step())
    total = time.perf_counter() - t0
    assert len(outputs) == batch, "engine lost requests"
    assert all(len(o.tokens) == args.new_tokens for o in outputs), "engine decoded too few"
    times = engine.times()
    decode_tokens = times.decode_tokens - before.decode_tokens - batch
    return {
        "e2e_tokens_per_s": batch * args.new_tokens / total,
        "decode_tokens_per_s": decode_tokens / max(times.decode_s - decode_first, 1e-9),
        "first_token_s": first - t0,
        "total_s": total,
    }


def run_hf(model: torch.nn.Module, prompts: np.ndarray, args: argparse.Namespace) -> dict:
    ids = torch.from_numpy(prompts.astype(np.int64))
    batch = ids.shape[0]

    def generate(n: int) -> float:
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=args.temperature > 0,
                temperature=args.temperature if args.temperature > 0 else None,
                top_p=args.top_p,
                top_k=0,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + n, "generate decoded too few"
        return elapsed

    first = generate(1)
    total = generate(args.new_tokens)
    return {
        "e2e_tokens_per_s": batch * args.new_tokens / total,
        "decode_tokens_per_s": batch * (args.new_tokens - 1) / max(total - first, 1e-9),
        "first_token_s": first,
        "total_s": total,
    }


def measure_pull(engine: Any, model: torch.nn.Module, pulls: int) -> dict[str, float]:
    """Median seconds of a Pull from a PS worker process (shared memory) and of the
    engine's load of the pulled weights, over ``pulls`` versions."""
    from parameter_server.torch_compat import layout_of_state_dict, state_dict_to_numpy
    from parameter_server.worker import PSWorker
    from staleflow.runtime.workers.weight_transfer import TransportPullSource

    state = {n: p.detach() for n, p in model.named_parameters()}
    layout = layout_of_state_dict(state)
    fetch_s, load_s = [], []
    with PSWorker.start(layout, num_slots=2) as ps, ps.connect("shm") as client:
        source = TransportPullSource(ps.connect("shm"), layout)
        for version in range(1, pulls + 1):
            client.push(state_dict_to_numpy(state), version)
            t0 = time.perf_counter()
            got, weights = source.fetch(version)
            t1 = time.perf_counter()
            engine.load_weights(weights, got)
            load_s.append(time.perf_counter() - t1)
            fetch_s.append(t1 - t0)
    return {
        "ps_fetch_s": statistics.median(fetch_s),
        "load_s": statistics.median(load_s),
        "bytes": float(layout.nbytes),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # generate()'s notes on unset generation flags
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, args.vocab, size=(args.batch, args.prompt_len), dtype=np.int32)
    load_before = os.getloadavg()[0]
    engines: dict[str, Any] = {"embedded": embedded(model, prompts, args)}
    extra: dict[str, Any] = {"vllm": None if HAVE_VLLM and not args.no_vllm else "not run"}
    with tempfile.TemporaryDirectory() as tmp:
        if HAVE_VLLM and not args.no_vllm:
            model.save_pretrained(tmp)
            engines["vllm"], extra["vllm_start_s"] = start_vllm(Path(tmp), prompts, args)
            if args.threads:  # vLLM's CPU worker may have changed the process's threads
                torch.set_num_threads(args.threads)
        warm = argparse.Namespace(**{**vars(args), "new_tokens": 4})
        for engine in engines.values():
            run_engine(engine, prompts[:2], warm)
        runs: dict[str, list[dict]] = {name: [] for name in (*engines, "hf_generate")}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(run_engine(engine, prompts, args))
            runs["hf_generate"].append(run_hf(model, prompts, args))
        pulls = {name: measure_pull(engine, model, args.pulls) for name, engine in engines.items()}
        for engine in engines.values():
            engine.close()
    result: dict[str, Any] = {
        "model": {
            "params": params,
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
        },
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "pull": pulls,
        **extra,
    }
    for name, rs in runs.items():
        result[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    hf = result["hf_generate"]
    for name in engines:
        result[f"{name}_decode_speedup"] = (
            result[name]["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
        )
    print(
        f"Qwen2 {params / 1e6:.2f}M params, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, T={args.temperature} top_p={args.top_p}, "
        f"{result['threads']} threads, median of {args.repeats}, load average "
        f"{load_before:.1f} -> {result['load_avg_1m'][1]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'':14}{'decode tok/s':>14}{'end-to-end tok/s':>18}{'total s':>10}{'x generate':>12}")
    for name in (*engines, "hf_generate"):
        r = result[name]
        ratio = result.get(f"{name}_decode_speedup", 1.0)
        print(
            f"{name:14}{r['decode_tokens_per_s']:>14.0f}{r['e2e_tokens_per_s']:>18.0f}"
            f"{r['total_s']:>10.2f}{ratio:>12.2f}"
        )
    if "vllm" not in engines:
        print("vllm: not run (vllm does not import here, or --no-vllm)")
    else:
        print(f"vllm engine start: {extra['vllm_start_s']:.1f} s")
    print(f"Pull of {pulls['embedded']['bytes'] / 2**20:.1f} MiB (median of {args.pulls}):")
    for name, p in pulls.items():
        print(
            f"  {name:12} PS fetch {p['ps_fetch_s'] * 1e3:8.1f} ms   load {p['load_s'] * 1e3:8.1f} ms"
        )
    print("  sglang       not measurable here (no GPU, sglang not installed)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
