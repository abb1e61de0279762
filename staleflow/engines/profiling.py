"""``staleflow profile``: fit the cost model (Appendix B) of a rollout engine on this
machine and save it as a config snippet that ``staleflow launch --config`` reads.

The coordinator plans with ``L(n, kv) = k1*kv + max(k2, k3*n) + k4`` seconds per decode
step; the preset it ships with describes Qwen3-30B on an H20, whose ratios say nothing
about a tiny model on a CPU. Here every grid point is ``n`` requests of ``length`` prompt
tokens, decoded a few steps after their prefill; the median decode-step time is one
sample for :func:`coordinator.profiler.fit_cost_model`. :func:`profile_engine` times any
:class:`~staleflow.engines.base.RolloutEngine`; :func:`profile_embedded` builds the
embedded engine on a built-in model and fits it (what the command runs).
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from coordinator.profiler import CostModelFit, LatencySample, fit_cost_model
from staleflow.engines.base import GenerationRequest, RolloutEngine
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from staleflow.models.build import build_arithmetic_model

logger = logging.getLogger(__name__)

RUNNING = (1, 2, 4, 8, 16, 32, 64)
LENGTHS = (16, 64, 160, 320)


@dataclass(frozen=True, slots=True)
class ProfileResult:
    fit: CostModelFit
    samples: tuple[LatencySample, ...]
    preset: str
    max_running: int
    kv_budget: int
    seconds: float


def profile_embedded(
    preset: str = "tiny",
    *,
    max_running: int = 64,
    kv_budget: int = 16384,
    running: Sequence[int] = RUNNING,
    lengths: Sequence[int] = LENGTHS,
    steps: int = 4,
    seed: int = 0,
    num_threads: int | None = None,
    on_sample: Callable[[LatencySample], None] | None = None,
) -> ProfileResult:
    """Time decode steps of the embedded engine on the built-in model ``preset`` over the
    grid ``running x lengths`` (points that exceed ``max_running`` or the KV budget are
    skipped) and fit the cost model."""

    if steps < 1:
        raise ValueError(f"steps={steps}: time at least 1 decode step per point")
    started = time.perf_counter()
    model, tokenizer = build_arithmetic_model(preset, seed=seed)
    max_seq_len = int(model.config.max_position_embeddings)
    config = EmbeddedEngineConfig(
        kv_budget_tokens=max(kv_budget, max_seq_len),
        max_running=max_running,
        max_seq_len=max_seq_len,
        temperature=1.0,
        eos_token_id=None,  # length stops only: every request decodes every timed step
        seed=seed,
        num_threads=num_threads,
    )
    samples = profile_engine(
        EmbeddedEngine(model, config),
        vocab=tokenizer.vocab_size,
        max_seq_len=max_seq_len,
        kv_budget_tokens=config.kv_budget_tokens,
        max_running=max_running,
        running=running,
        lengths=lengths,
        steps=steps,
        seed=seed,
        on_sample=on_sample,
    )
    if len(samples) < 4:
        raise ValueError(
            f"only {len(samples)} grid points fit max_running={max_running} and "
            f"kv_budget={kv_budget}: give more running counts or shorter lengths"
        )
    fit = fit_cost_model(samples, kv_budget=float(kv_budget))
    return ProfileResult(
        fit=fit,
        samples=tuple(samples),
        preset=preset,
        max_running=max_running,
        kv_budget=kv_budget,
        seconds=time.perf_counter() - started,
    )


def profile_engine(
    engine: RolloutEngine,
    *,
    vocab: int,
    max_seq_len: int,
    kv_budget_tokens: int,
    max_running: int,
    running: Sequence[int] = RUNNING,
    lengths: Sequence[int] = LENGTHS,
    steps: int = 4,
    seed: int = 0,
    on_sample: Callable[[LatencySample], None] | None = None,
) -> list[LatencySample]:
    """One latency sample per grid point ``running x lengths`` that fits the engine's
    slots and KV budget: ``n`` random prompts, admitted and prefilled by one untimed
    step, then ``steps`` timed decode steps (the engine's own decode clock). The engine
    must not stop a request before ``steps + 2`` tokens (no EOS)."""
    rng = np.random.default_rng(seed)
    samples: list[LatencySample] = []
    next_id = 0
    for n in running:
        for length in lengths:
            # prompt + the tokens decoded here must fit a slot and, all together, the budget
            if n > max_running or length + steps + 2 > max_seq_len:
                continue
            if n * (length + steps + 2) > kv_budget_tokens:
                continue
            ids = list(range(next_id, next_id + n))
            next_id += n
            empty = np.zeros(0, np.int32)
            engine.submit(
                [
                    GenerationRequest(
                        traj_id=i,
                        prompt=rng.integers(0, vocab, length, dtype=np.int32),
                        tokens=empty,
                        logprobs=np.zeros(0, np.float32),
                        versions=empty,
                        max_response=steps + 2,
                    )
                    for i in ids
                ]
            )
            engine.step()  # admission, prefill and a first decode: not timed
            kv, times = 0, []
            for _ in range(steps):
                kv += engine.state().kv_tokens
                before = engine.times().decode_s
                engine.step()
                times.append(engine.times().decode_s - before)
            engine.abort(ids)
            # the median: on a shared machine one step in a few is slowed by a neighbour
            sample = LatencySample(n, kv / steps, float(np.median(times)))
            samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
    return samples


def cost_model_section(result: ProfileResult) -> dict[str, dict[str, Any]]:
    """The ``coordinator.cost_model`` part of a run config, with the engine settings it
    was measured under (the coordinator's budget must be the engines' own)."""
    m = result.fit.model
    return {
        "rollout": {"kv_budget_tokens": result.kv_budget, "max_running": result.max_running},
        "coordinator": {
            "cost_model": {
                "k1": float(m.k1),
                "k2": float(m.k2),
                "k3": float(m.k3),
                "k4": float(m.k4),
                "k5": float(m.k5),
                "kv_budget": float(m.kv_budget),
            }
        },
    }


def overrides(result: ProfileResult) -> list[str]:
    """The same as ``key=value`` overrides for ``staleflow launch``."""
    out: list[str] = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out.append(f"{prefix}={value:.6g}" if isinstance(value, float) else f"{prefix}={value}")

    walk("", cost_model_section(result))
    return out


def write_profile(result: ProfileResult, path: str | Path) -> Path:
    """A YAML config snippet (``staleflow launch --config PATH`` reads it as is)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fit = result.fit
    header = [
        "# Cost model of the embedded rollout engine, fitted by `staleflow profile`",
        f"# on {platform.node() or 'this machine'} ({platform.processor() or platform.machine()}), "
        f"{datetime.now():%Y-%m-%d %H:%M}",
        f"# model preset {result.preset}, max_running {result.max_running}, "
        f"{fit.samples} samples, mean relative error {fit.mean_relative_error:.1%} "
        f"(max {fit.max_relative_error:.1%}), knee at {fit.knee:.1f} running",
        "# Use: staleflow launch --config THIS_FILE (other keys keep their defaults),",
        "# or copy the coordinator section into your own config file.",
        "# It sets rollout.kv_budget_tokens and max_running to what was measured.",
    ]
    body = yaml.safe_dump(cost_model_section(result), sort_keys=False)
    p.write_text("\n".join(header) + "\n" + body, encoding="utf-8")
    return p
