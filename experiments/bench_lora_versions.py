"""What a version moves with LoRA (``trainer.lora``) against full weights, side by side.

The policy is a Qwen2 configuration built on PyTorch's meta device (shapes and dtypes, no
memory, no download): ``qwen2-0.5b`` is Qwen2-0.5B's architecture (24 layers, hidden 896,
14 / 2 heads, MLP 4864, vocabulary 151,936, tied embeddings). Its layouts are exactly
what a run registers on the parameter server (``staleflow.runtime.workers.specs``):

* **full**: every weight, every version;
* **adapter**: the LoRA matrices of ``--rank`` on ``--targets``, every version; the frozen
  **base** beside them once per PS replica and once per instance.

For each, a PS worker process holds one version and a reader process Pulls it over each
transport into its own buffer (``--repeats`` times, median), as an instance Pulls from the
replica on its node (shm) or across nodes (socket); with LoRA the reader also Pulls the
base once. ``--skip-full-pull`` keeps only the byte counts of full weights (the full
store holds ``--num-slots`` x the model in shared memory: 4 GB for 0.5B in float32).

Usage:
    python experiments/bench_lora_versions.py --json lora.json
    python experiments/bench_lora_versions.py --model tiny --repeats 2   # seconds, a check
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing as mp
import platform
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from parameter_server.layout import Layout
from parameter_server.transport import connect
from parameter_server.transport.base import Endpoint
from parameter_server.worker import PSWorker

# Qwen2-0.5B's config.json, the fields that set the shapes
MODELS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
    "tiny": {  # the built-in tiny preset's shape with a real tokenizer's vocabulary
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    },
}


def layouts(model: str, rank: int, targets: str, dtype: str = "float32") -> dict[str, Layout]:
    """The PS layouts of ``model``: ``full`` (no LoRA), ``adapter`` and ``base`` (LoRA)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from parameter_server.torch_compat import layout_of_state_dict
    from staleflow.config.lora import LoraConfig
    from staleflow.models import lora as lora_lib
    from staleflow.models.state import policy_state

    config = Qwen2Config(**MODELS[model])
    with torch.device("meta"):
        policy = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
        full = layout_of_state_dict(policy_state(policy))
        lora_lib.add_adapters(
            policy, LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=targets)
        )
    return {
        "full": full,
        "adapter": layout_of_state_dict(lora_lib.adapter_state(policy)),
        "base": layout_of_state_dict(lora_lib.base_state(policy)),
    }


def _fill(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _reader(
    endpoint: Endpoint, transports: list[str], repeats: int, base: bool, out: mp.Queue
) -> None:
    """Runs in a process of its own: an instance's Pulls."""
    report: dict[str, Any] = {}
    for name in transports:
        with connect(endpoint, name) as t:
            dest = np.empty(t.layout.nbytes, np.uint8)
            dest[:: os.sysconf("SC_PAGE_SIZE")] = 0  # prefaulted, as a reused buffer is
            t.pull(dest)  # warm-up: connection and mapping set-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                t.pull(dest)
                times.append(time.perf_counter() - start)
            row: dict[str, Any] = {"median_s": statistics.median(times), "min_s": min(times)}
            row["checksum"] = int(dest[::4099].astype(np.uint64).sum())
            if base and t.base_layout is not None:
                buffer = np.empty(t.base_layout.nbytes, np.uint8)  # fresh: it moves once
                start = time.perf_counter()
                t.pull_base(buffer)
                row["base_once_s"] = time.perf_counter() - start
            report[name] = row
    out.put(report)


def bench_pulls(
    layout: Layout, base: Layout | None, transports: list[str], repeats: int, slots: int
) -> dict[str, Any]:
    """Publish one version (and the base) on a worker; a reader process Pulls them."""
    with PSWorker.start(layout, num_slots=slots, base=base, timeout=600) as worker:
        with connect(worker.endpoint, "shm") as writer:
            if base is not None:
                writer.push_base(_fill(base.nbytes, 1))
            packed = _fill(layout.nbytes, 2)
            writer.push(packed)
            expected = int(packed[::4099].astype(np.uint64).sum())
            del packed
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        reader = ctx.Process(
            target=_reader, args=(worker.endpoint, transports, repeats, base is not None, out)
        )
        reader.start()
        while True:  # a reader that died says so here, instead of a wait without end
            try:
                report = out.get(timeout=5)
                break
            except queue.Empty:
                if not reader.is_alive():
                    raise RuntimeError(
                        f"the reader process died (exit {reader.exitcode})"
                    ) from None
        reader.join(60)
    for row in report.values():
        row["verified"] = row.pop("checksum") == expected
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2-0.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--transports", default="shm,socket")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-slots", type=int, default=2)
    p.add_argument("--skip-full-pull", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]

    found = layouts(args.model, args.rank, args.targets, args.dtype)
    full, adapter, base = found["full"], found["adapter"], found["base"]
    result: dict[str, Any] = {
        "model": args.model,
        "config": MODELS[args.model],
        "rank": args.rank,
        "targets": args.targets.split(","),
        "dtype": args.dtype,
        "full": {
            "params": sum(s.numel for s in full),
            "bytes_per_version": full.nbytes,
        },
        "adapter": {
            "params": sum(s.numel for s in adapter),
            "bytes_per_version": adapter.nbytes,
            "base_bytes_once": base.nbytes,
        },
        "ratio": full.nbytes / adapter.nbytes,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version},
    }
    result["adapter"]["pull"] = bench_pulls(adapter, base, transports, args.repeats, args.num_slots)
    if not args.skip_full_pull:
        result["full"]["pull"] = bench_pulls(full, None, transports, args.repeats, args.num_slots)

    mib = 1 << 20
    print(
        f"{args.model}, LoRA rank {args.rank} on {args.targets} ({args.dtype}); "
        "a Pull into another process, median of "
        f"{args.repeats}"
    )
    print(
        f"{'':<10}{'params':>14}{'bytes/version':>18}"
        + "".join(f"{t + ' pull':>14}" for t in transports)
    )
    for name in ("full", "adapter"):
        row = result[name]
        pulls = row.get("pull", {})
        cells = "".join(
            f"{pulls[t]['median_s'] * 1e3:>12.2f}ms" if t in pulls else f"{'-':>14}"
            for t in transports
        )
        print(f"{name:<10}{row['params']:>14,}{row['bytes_per_version'] / mib:>15.2f}MiB{cells}")
    once = result["adapter"]["pull"]
    base_cells = ", ".join(f"{t} {once[t]['base_once_s']:.2f} s" for t in transports if t in once)
    print(f"base, once per replica and instance: {base.nbytes / mib:.1f} MiB ({base_cells})")
    print(f"adapter versions move {result['ratio']:.1f}x fewer bytes than full weights")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
