"""Training batches sampled by the real embedded rollout engine (no fakes): the behaviour
logprobs are what an engine records, ``log_softmax(logits / T)`` of the sampled tokens."""

from __future__ import annotations

import copy

import numpy as np
import torch

from staleflow.engines.base import GenerationRequest
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory

PROMPTS = ("12+3=", "7+8=", "40+2=", "9+9=")


def sample_batch(
    model: torch.nn.Module,
    tokenizer,
    *,
    temperature: float,
    groups: int = 2,
    group_size: int = 4,
    max_response: int = 6,
    version: int = 0,
    seed: int = 0,
) -> TrainingBatch:
    """``groups`` prompts x ``group_size`` responses sampled from a copy of ``model`` at
    ``temperature``; rewards alternate within each group so no group is flat."""
    engine = EmbeddedEngine(
        copy.deepcopy(model),
        EmbeddedEngineConfig(
            kv_budget_tokens=4096,
            max_running=64,
            max_seq_len=64,
            temperature=temperature,
            eos_token_id=tokenizer.eos_id,
            seed=seed,
        ),
        version=version,
    )
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    prompts = [tokenizer.encode(PROMPTS[g % len(PROMPTS)], add_bos=True) for g in range(groups)]
    requests = [
        GenerationRequest(g * group_size + i, prompts[g], empty_i, empty_f, empty_i, max_response)
        for g in range(groups)
        for i in range(group_size)
    ]
    engine.submit(requests)
    outputs = {}
    while engine.has_work:
        for out in engine.step():
            outputs[out.traj_id] = out
    batch_groups = []
    for g in range(groups):
        trajs = []
        for i in range(group_size):
            out = outputs[g * group_size + i]
            trajs.append(
                TrainingTrajectory(
                    traj_id=out.traj_id,
                    v_traj=version,
                    tokens=out.tokens,
                    logprobs=out.logprobs,
                    versions=out.versions,
                    reward=float(i % 2),
                    finish_reason=out.finish_reason or "length",
                )
            )
        batch_groups.append(TrainingGroup(g, g, "", prompts[g], tuple(trajs)))
    return TrainingBatch(tuple(batch_groups), (), temperature)
