"""The measuring stages of ``scripts/gpu-check`` (CUDA GPU only), one subcommand each.

Every subcommand prints its figures as one last line ``GPU-CHECK-RESULT <json>``, which
``scripts/gpu-check`` reads; the rest of the output is its log.

* ``model DIR``: the 0.5B-class Qwen2 policy the other stages use, built from a
  configuration (nothing downloaded): Qwen2.5-0.5B's layers (hidden 896, 24 layers, 14
  heads, 2 KV heads, MLP 4864, tied embeddings) over the built-in task's 17-token
  vocabulary, about 358M parameters, saved with its tokenizer by ``save_pretrained``.
* ``megatron DIR``: one Megatron-core rank on the GPU in bfloat16 (its process group on
  NCCL, Megatron's own optimizer, as ``trainer.backend=megatron`` runs on a GPU node)
  trains ``--steps`` steps on a synthetic GRPO batch and Pushes every version to a real
  PS worker (the sharded Push: the rank copies its shard off the GPU and sends it), then
  an instance-side reader Pulls the last version from the PS over shared memory.
  Figures: median step seconds, MFU, Push and PS-Pull seconds per GiB.
* ``vllm DIR``: vLLM on the GPU (bfloat16) through StaleFlow's adapter: decode
  tokens/s of a batch, and the Pull into the engine (PS fetch + ``load_weights``) per GiB.
* ``launch DIR RUN``: ``staleflow launch`` with ``rollout.backend=vllm`` and
  ``trainer.backend=megatron`` both on the GPU for ``--steps`` steps; the time from the
  call to the first training step, rollout tokens/s and the trainer's step figures.

MFU counts ``6 * N`` FLOPs per token processed (forward and backward over prompt and
response; N = the non-embedding parameters; attention's own FLOPs left out, so the figure
is a slight underestimate) against the GPU's dense bfloat16 peak (``--peak-tflops``, else
from the device's name).

    python experiments/gpu_probe.py model /tmp/policy
    python experiments/gpu_probe.py megatron /tmp/policy --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULT = "GPU-CHECK-RESULT"
GIB = float(1 << 30)
# Qwen2.5-0.5B's layer sizes (its config.json); the vocabulary is the built-in task's
QWEN2_05B = dict(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    tie_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
)
# dense bfloat16 peak of one GPU, TFLOP/s (the vendors' datasheets, without sparsity)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.1}


def emit(result: dict[str, Any]) -> None:
    print(f"{RESULT} {json.dumps(result)}", flush=True)


def peak_tflops(given: float | None) -> tuple[float | None, str]:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if given:
        return given, name
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value, name
    return None, name


def non_embedding_params(config: dict[str, Any]) -> int:
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    attention = h * h + h + 2 * (h * kv + kv) + h * h
    mlp = 3 * h * config["intermediate_size"]
    return layers * (attention + mlp + 2 * h) + h


# --size smoke: the same stages on a tiny model, to try the probe itself on a CPU machine
SMOKE = dict(
    QWEN2_05B, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128
)


def build(folder: Path, size: str) -> dict[str, Any]:
    import torch

    from staleflow.models.build import arithmetic_tokenizer, build_model
    from staleflow.models.checkpoint import save_pretrained
    from staleflow.models.presets import ModelPreset

    tokenizer = arithmetic_tokenizer()
    model = build_model(
        ModelPreset(**(QWEN2_05B if size == "0.5b" else SMOKE)),
        tokenizer.vocab_size,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    model = model.to(torch.bfloat16)
    save_pretrained(model, tokenizer, folder)
    config = json.loads((folder / "config.json").read_text())
    return {
        "params": int(sum(p.numel() for p in model.parameters())),
        "non_embedding_params": non_embedding_params(config),
        "vocab": tokenizer.vocab_size,
        "folder": str(folder),
    }


def load(folder: Path, dtype: str) -> tuple[Any, Any]:
    import torch

    from staleflow.models.checkpoint import load_pretrained

    return load_pretrained(folder, dtype=getattr(torch, dtype))


def _batch(vocab: int, groups: int, group_size: int, prompt: int, response: int) -> Any:
    from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory

    rng = np.random.default_rng(0)
    out = []
    for g in range(groups):
        p = rng.integers(3, vocab, prompt).astype(np.int32)
        trajs = []
        for i in range(group_size):
            n = int(rng.integers(response // 2, response + 1))
            trajs.append(
                TrainingTrajectory(
                    traj_id=g * group_size + i,
                    v_traj=0,
                    tokens=rng.integers(3, vocab, n).astype(np.int32),
                    logprobs=-rng.uniform(0.1, 3.0, n).astype(np.float32),
                    versions=np.zeros(n, np.int32),
                    reward=float(i % 2),
                    finish_reason="length",
                )
            )
        out.append(TrainingGroup(g, g, "", p, tuple(trajs)))
    return TrainingBatch(tuple(out))


def _megatron_rank(rank: int, world: int, address: str, payload: dict[str, Any]) -> dict:
    import torch
    import torch.distributed as dist

    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed

    init_distributed(rank, world, address)
    backend = dist.get_backend()
    r = MegatronRank(payload["spec"])
    r.load_hf(payload["hf"])
    nbytes = r.attach_push(payload["endpoint"])
    steps, pushes, handle = [], [], None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for i in range(payload["steps"] + 1):
        sync()
        start = time.perf_counter()
        r.train_step(payload["batch"])  # fences the previous Push before the update
        sync()
        if i:  # the first step warms up (kernels, allocator)
            steps.append(time.perf_counter() - start)
        if handle is not None and handle.timing is not None:
            pushes.append(handle.timing.copy_s)
        handle = r.start_push()
    handle.wait(600)
    pushes.append(handle.timing.copy_s)
    version = r.version
    memory = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    r.close()
    return {
        "steps": steps,
        "pushes": pushes,
        "push_bytes": nbytes,
        "version": version,
        "backend": backend,
        "max_memory_gib": memory,
    }


def megatron(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from parameter_server.torch_compat import layout_of_state_dict, state_dict_to_numpy
    from parameter_server.transport import connect
    from parameter_server.worker import PSWorker
    from staleflow.config import TrainerConfig
    from staleflow.models.state import policy_state
    from staleflow.runtime.workers.weight_transfer import TransportPullSource
    from staleflow.trainers.megatron.local import run_local
    from staleflow.trainers.megatron.rank import RankSpec

    # bf16 as on a GPU node; the CPU smoke run trains float32 (the CPU rank keeps its
    # norms in float32, which a bf16 Push plan refuses)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    model, tokenizer = load(folder, dtype)
    state = policy_state(model)
    layout = layout_of_state_dict(state)
    weights = state_dict_to_numpy(state)
    batch = _batch(tokenizer.vocab_size, args.groups, args.group_size, args.prompt, args.response)
    tokens = sum(len(g.prompt) + len(t.tokens) for g in batch.groups for t in g.trajectories)
    spec = RankSpec(
        model.config.to_dict(),
        TrainerConfig(backend="megatron", tp=1),
        pad_id=tokenizer.pad_id,
        dtype=dtype,
    )
    with PSWorker.start(layout, 3) as ps:
        with connect(ps.endpoint, "shm") as client:
            client.push(weights, 0)
        payload = {
            "spec": spec,
            "hf": weights,
            "batch": batch,
            "endpoint": ps.endpoint,
            "steps": args.steps,
        }
        out = run_local(1, _megatron_rank, payload, timeout_s=args.timeout)
        source = TransportPullSource(ps.connect("shm"), layout)
        pulls = []
        for _ in range(3):
            t0 = time.perf_counter()
            got, _ = source.fetch(out["version"])
            pulls.append(time.perf_counter() - t0)
    step_s = statistics.median(out["steps"])
    n = non_embedding_params(model.config.to_dict())
    peak, device = peak_tflops(args.peak_tflops)
    achieved = 6.0 * n * tokens / step_s / 1e12
    return {
        "device": device,
        "process_group": out["backend"],
        "dtype": dtype,
        "non_embedding_params": n,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "train_tokens_per_s": tokens / step_s,
        "tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "push_gib": out["push_bytes"] / GIB,
        "push_s_per_gib": statistics.median(out["pushes"]) / (out["push_bytes"] / GIB),
        "ps_pull_gib": layout.nbytes / GIB,
        "ps_pull_s_per_gib": statistics.median(pulls) / (layout.nbytes / GIB),
        "pulled_version": got,
        "max_memory_gib": out["max_memory_gib"],
    }


def vllm(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    from parameter_server.torch_compat import layout_of_state_dict, state_dict_to_numpy
    from parameter_server.worker import PSWorker
    from staleflow.engines.base import GenerationRequest
    from staleflow.engines.vllm import VLLMEngine, VLLMEngineConfig
    from staleflow.models.state import policy_state
    from staleflow.runtime.workers.weight_transfer import TransportPullSource

    model, tokenizer = load(folder, "float32")  # the PS serves what launch serves: float32
    batch, plen, new = args.batch, args.prompt, args.response
    t0 = time.perf_counter()
    engine = VLLMEngine(
        VLLMEngineConfig(
            model_path=str(folder),
            dtype="bfloat16",
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_budget_tokens=batch * (plen + new + 1),
            max_running=batch,
            max_seq_len=plen + new,
            temperature=1.0,
            top_p=1.0,
            eos_token_id=None,
            seed=0,
        )
    )
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, tokenizer.vocab_size, size=(batch, plen), dtype=np.int32)
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)

    def generate(n_new: int) -> tuple[float, int]:
        engine.submit(
            [
                GenerationRequest(i, prompts[i], empty_i, empty_f, empty_i, n_new)
                for i in range(batch)
            ]
        )
        t = time.perf_counter()
        done = []
        while engine.has_work:
            done.extend(engine.step())
        if len(done) != batch:
            raise RuntimeError(f"vLLM returned {len(done)} of {batch} requests")
        return time.perf_counter() - t, sum(len(o.tokens) for o in done)

    generate(4)  # warm-up: CUDA graphs, allocator
    first_s, _ = generate(1)
    total_s, generated = generate(new)
    decode = (generated - batch) / max(total_s - first_s, 1e-9)
    state = policy_state(model)
    layout = layout_of_state_dict(state)
    fetch_s, load_s = [], []
    with PSWorker.start(layout, num_slots=2) as ps, ps.connect("shm") as client:
        source = TransportPullSource(ps.connect("shm"), layout)
        for version in range(1, 4):
            client.push(state_dict_to_numpy(state), version)
            t1 = time.perf_counter()
            got, weights = source.fetch(version)
            t2 = time.perf_counter()
            engine.load_weights(weights, got)
            load_s.append(time.perf_counter() - t2)
            fetch_s.append(t2 - t1)
    after_s, _ = generate(8)  # the engine still generates after the loads
    engine.close()
    gib = layout.nbytes / GIB
    return {
        "engine_start_s": start_s,
        "batch": batch,
        "decode_tokens_per_s": decode,
        "e2e_tokens_per_s": generated / total_s,
        "pull_gib": gib,
        "pull_fetch_s_per_gib": statistics.median(fetch_s) / gib,
        "pull_load_s_per_gib": statistics.median(load_s) / gib,
        "pull_s_per_gib": (statistics.median(fetch_s) + statistics.median(load_s)) / gib,
        "generate_after_pull_s": after_s,
    }


def launch_run(folder: Path, run: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    # one GPU shared by the instance and the trainer rank (Ray's fractional GPUs)
    gpu = (
        ["rollout.vllm.dtype=bfloat16", "resources.rollout.gpus=0.5", "resources.trainer.gpus=0.5"]
        if torch.cuda.is_available()
        else []
    )
    cfg = load_config(
        None,
        [
            f"steps={args.steps}",
            f"run_dir={run}",
            f"model.checkpoint={folder}",
            "eta=1",
            "rollout.backend=vllm",
            "rollout.instances=1",
            f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
            "trainer.backend=megatron",
            "rollout.max_running=128",
            "rollout.kv_budget_tokens=65536",
            "rollout.max_response_tokens=64",
            "batch_size=8",
            "group_size=8",
            "eval.problems=32",
            "dashboard=false",
            *gpu,
        ],
    )
    t0 = time.perf_counter()
    first: list[float] = []
    result = launch(cfg, on_record=lambda rec: first or first.append(time.perf_counter() - t0))
    wall = time.perf_counter() - t0
    records = result.records
    if not records:
        raise RuntimeError("the launch trained no step")
    generated = sum((r.rewarded or 0) * (r.response_len_mean or 0.0) for r in records)
    train_s = [r.trainer_train_s for r in records[1:] if r.trainer_train_s] or [
        r.trainer_train_s for r in records if r.trainer_train_s
    ]
    return {
        "steps": len(records),
        "wall_s": wall,
        "time_to_first_step_s": first[0] if first else None,
        "rollout_tokens_per_s": generated / max(records[-1].elapsed_s, 1e-9),
        "trained_tokens_per_s": records[-1].tokens_per_s,
        "trainer_step_s": statistics.median(train_s) if train_s else None,
        "staleness_max": max((r.staleness_max or 0) for r in records),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("model", "megatron", "vllm", "launch"))
    p.add_argument("folder", type=Path, help="the policy's folder (written by `model`)")
    p.add_argument("run", type=Path, nargs="?", help="run folder (launch)")
    p.add_argument("--size", choices=("0.5b", "smoke"), default="0.5b", help="model (model)")
    p.add_argument("--cpu", action="store_true", help="allow a run without a GPU (smoke)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps")
    p.add_argument("--groups", type=int, default=16, help="groups per training batch")
    p.add_argument("--group-size", type=int, default=8, help="responses per group")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--response", type=int, default=256, help="longest response / new tokens")
    p.add_argument("--batch", type=int, default=128, help="sequences vLLM decodes together")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of one GPU")
    p.add_argument("--timeout", type=float, default=600.0, help="the rank's limit, seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.what == "model":
        args.folder.mkdir(parents=True, exist_ok=True)
        emit(build(args.folder, args.size))
        return 0
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_probe: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    if args.what == "megatron":
        emit(megatron(args.folder, args))
    elif args.what == "vllm":
        emit(vllm(args.folder, args))
    else:
        run = args.run or Path(tempfile.mkdtemp(prefix="gpu-check-run-"))
        emit(launch_run(args.folder, run, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
