"""The supervised warm-up of the built-in model for the calculator task, and the
multi-turn sampler that measures it.

As for the arithmetic task (``staleflow.models.warmup``), RL learns only from groups
whose rewards differ, so the built-in model first learns the format from solved
episodes: call the calculator with the problem's expression, read its answer, state it
(``staleflow.envs.calculator.demonstration``). The loss covers the model's turns only,
never the tool's answer, as RL's does. The warm-up stops at a target success rate of
whole episodes played against the environment (:func:`play_episodes`), and the result is
cached like the arithmetic warm-up's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from staleflow.data.synthetic import ArithmeticConfig
from staleflow.data.tokenizer import Tokenizer
from staleflow.envs.base import Environment, EnvSample, EpisodeLimits, ModelTurn, after_step
from staleflow.envs.calculator import (
    CalculatorEnvironment,
    calculator_samples,
    calculator_tokenizer,
    demonstration,
)
from staleflow.envs.formats import PlainFormat, TurnFormat
from staleflow.models.build import build_model
from staleflow.models.presets import ModelPreset, get_preset
from staleflow.models.threads import idle_cores, torch_threads
from staleflow.models.warmup import (
    DEFAULT_LR,
    META_FILE,
    cache_entry,
    cache_key,
    store_entry,
    warmup,
)
from staleflow.progress import SILENT, Progress

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

VALIDATION_LIMITS = EpisodeLimits(max_turns=4, max_tokens=120)
# The recipe (measured on 2 cores, docs/agentic.md "Learning"): a demonstration is about
# 120 tokens, 8 times an arithmetic example, but all of it is fixed markup except the
# expression and the answer the model copies, so batches of 32 suffice. The micro model
# (the task's default, config.env.CALCULATOR_PRESET) learns to copy in a sudden jump,
# after about 600 steps of 32 at lr 1e-2 (a few minutes), no success before it.
CALCULATOR_BATCH_SIZE = 32
CALCULATOR_LR = {"micro": 1e-2}  # by preset; any other: the arithmetic warm-up's
CHECK_EVERY = 25  # steps between validation checks: the jump takes about 100 steps
VALIDATION_EPISODES = 128
RECIPE = 2  # bump when the procedure changes what it produces (the cache key holds it)


def collate_demonstrations(
    demos: Sequence[Any], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ``prompt response`` ids and next-token labels that are -100 except on
    the response's trained tokens (mask True): the observation is context, as in RL."""
    rows = [np.concatenate([d.prompt, d.response]).astype(np.int64) for d in demos]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    for i, (row, d) in enumerate(zip(rows, demos, strict=True)):
        ids[i, : len(row)] = row
        start = len(d.prompt)
        target = np.where(d.mask, d.response, -100)
        labels[i, start - 1 : len(row) - 1] = target  # the label at t is the token at t + 1
    return torch.from_numpy(ids), torch.from_numpy(labels), int((labels >= 0).sum())


@torch.no_grad()
def play_episodes(
    model: PreTrainedModel,
    env: Environment,
    fmt: TurnFormat,
    samples: Sequence[EnvSample],
    limits: EpisodeLimits = VALIDATION_LIMITS,
    *,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Each sample's episode played by ``model`` against ``env`` (tool latency not
    waited), ending by the run's rule (:func:`after_step`); returns the rewards."""
    from transformers import GenerationConfig

    episodes = [env.start(s, seed=i) for i, s in enumerate(samples)]
    prompts = [fmt.prompt_ids(e) for e in episodes]
    states = [e.state for e in episodes]
    responses = [np.zeros(0, np.int32) for _ in samples]
    rewards = [0.0] * len(samples)
    live = list(range(len(samples)))
    eot = fmt.end_of_turn
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for turn in range(limits.max_turns):
            by_length: dict[tuple[int, int], list[int]] = {}
            for i in live:
                by_length.setdefault((len(prompts[i]), len(responses[i])), []).append(i)
            live = []
            for (_, done), members in sorted(by_length.items()):
                config = GenerationConfig(
                    do_sample=temperature > 0, max_new_tokens=max(1, limits.max_tokens - done),
                    pad_token_id=eot, eos_token_id=eot,
                    **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}),
                )  # fmt: skip
                context = np.stack([np.concatenate([prompts[i], responses[i]]) for i in members])
                ids = torch.from_numpy(context.astype(np.int64))
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
                )
                for i, row in zip(members, out[:, ids.shape[1] :].tolist(), strict=True):
                    if eot not in row:  # cut by the token budget mid-turn: the episode ends
                        rewards[i] = env.score(states[i])
                        continue
                    new = np.array(row[: row.index(eot) + 1], np.int32)
                    responses[i] = np.concatenate([responses[i], new])
                    step = env.step(states[i], ModelTurn(turn, fmt.turn_text(new), new))
                    states[i] = step.state
                    obs = (
                        np.zeros(0, np.int32)
                        if step.done
                        else fmt.observation_ids(step.observation)
                    )
                    verdict = after_step(
                        limits,
                        turns_done=turn + 1,
                        response_tokens=len(responses[i]),
                        step=step,
                        observation_ids=obs,
                    )
                    if verdict.ended:
                        rewards[i] = env.score(step.state)
                    else:
                        responses[i] = np.concatenate([responses[i], verdict.observation_ids])
                        live.append(i)
            if not live:
                break
    model.train(was_training)
    return rewards


def success_rate(
    model: PreTrainedModel,
    env: Environment,
    fmt: TurnFormat,
    samples: Sequence[EnvSample],
    limits: EpisodeLimits = VALIDATION_LIMITS,
    *,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """The mean reward of :func:`play_episodes` (for a task scoring 0 or 1, the share of
    episodes solved), on the cores other jobs leave free."""
    with torch_threads(idle_cores()):
        rewards = play_episodes(
            model, env, fmt, samples, limits, temperature=temperature, seed=seed
        )
    return float(np.mean(rewards)) if rewards else 0.0


def build_calculator_model(
    preset: str | ModelPreset, *, seed: int = 0
) -> tuple[PreTrainedModel, Tokenizer]:
    """An untrained built-in model with the calculator task's tokenizer."""
    tokenizer = calculator_tokenizer()
    model = build_model(
        preset, tokenizer.vocab_size, seed=seed, pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
    )  # fmt: skip
    return model, tokenizer


def _stream(task_config: ArithmeticConfig, salt: str, seed: int) -> ArithmeticConfig:
    digest = hashlib.sha256(f"staleflow-tool-{salt}:{task_config.seed}:{seed}".encode()).digest()
    return replace(task_config, seed=int.from_bytes(digest[:8], "little"))


def ensure_warm_calculator_checkpoint(
    preset: str | ModelPreset,
    task_config: ArithmeticConfig,
    *,
    steps: int,
    batch_size: int = CALCULATOR_BATCH_SIZE,
    lr: float | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    target_accuracy: float | None = None,
    progress: Progress = SILENT,
) -> Path:
    """The directory of the built-in model warmed up on calculator demonstrations (model,
    tokenizer, ``warmup.json``), built on the first call and reused after; with
    ``target_accuracy``, it stops once that share of ``VALIDATION_EPISODES`` validation
    episodes succeed at temperature 1 (checked every ``CHECK_EVERY`` steps). ``lr``
    None: the preset's (``CALCULATOR_LR``)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    name = f"{preset if isinstance(preset, str) else 'custom'}-calculator"
    if lr is None:
        lr = CALCULATOR_LR.get(preset, DEFAULT_LR) if isinstance(preset, str) else DEFAULT_LR
    tokenizer = calculator_tokenizer()
    key = cache_key(p, task_config, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    key.update(
        alphabet=tokenizer.alphabet, task="calculator", target_accuracy=target_accuracy,
        recipe=RECIPE, check=[CHECK_EVERY, VALIDATION_EPISODES, asdict(VALIDATION_LIMITS)],
    )  # fmt: skip
    root, final = cache_entry(cache_dir, name, key)
    if (final / META_FILE).is_file():
        return final
    fmt = PlainFormat(tokenizer)
    env = CalculatorEnvironment(latency_scale_s=0.0)
    train = _stream(task_config, "warmup", seed)
    valid = calculator_samples(_stream(task_config, "validation", seed), VALIDATION_EPISODES)
    model, _ = build_calculator_model(p, seed=seed)
    checks: list[tuple[int, float]] = []

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        samples = calculator_samples(train, batch_size, step * batch_size)
        demos = [demonstration(s, fmt, tokenizer) for s in samples]
        return collate_demonstrations(demos, tokenizer.pad_id)

    def reached(step: int) -> bool:
        rewards = play_episodes(model, env, fmt, valid, seed=seed)
        checks.append((step, float(np.mean(rewards))))
        phase.update(accuracy=checks[-1][1])
        logger.info("calculator warm-up step %d: episodes solved %.1f%%", step, 100 * checks[-1][1])
        return target_accuracy is not None and checks[-1][1] >= target_accuracy

    threads = idle_cores()
    phase = progress.phase(
        "warmup", f"warming up the built-in {name} model on tool-use demonstrations",
        total=steps, unit="steps", upper_bound=target_accuracy is not None,
    )  # fmt: skip
    with phase, torch_threads(threads):
        stats = warmup(
            model, tokenizer, None,  # the batches replace the task
            steps=steps, batch_size=batch_size, lr=lr, seed=seed, num_threads=threads,
            log_every=0, batches=batch, check_every=CHECK_EVERY,
            stop=reached if target_accuracy is not None else None,
            on_step=lambda step, loss: phase.update(done=step, loss=loss),
        )  # fmt: skip
        phase.finish(f"stopped at step {stats.steps}")
    meta = {"stats": asdict(stats), "validation": checks, "key": key, "preset_name": name}
    if checks:
        meta["accuracy_t1"] = checks[-1][1]
    store_entry(model, tokenizer, meta, root, final)
    return final
