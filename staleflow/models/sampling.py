"""Sampling responses from a policy and scoring them on the built-in task: how the warm-up
decides it has reached its target and how a run's held-out reward is measured."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from staleflow.data.synthetic import ArithmeticTask, extract_answer, solution_steps
from staleflow.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.no_grad()
def sample_responses(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    seed: int = 0,
    batch_size: int = 256,
    on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """Responses to ``prompts`` (text up to EOS), sampled at ``temperature`` or greedy at 0.

    Prompts are batched by length so no batch needs padding. The global torch RNG is
    left as it was. ``on_batch(n)`` is called after each batch with its size (progress).
    """
    from transformers import GenerationConfig

    if temperature < 0:
        raise ValueError(f"temperature={temperature}; use 0 for greedy decoding")
    # explicit "off" values, so a checkpoint's generation_config.json cannot narrow the
    # distribution being measured
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    config = GenerationConfig(
        do_sample=temperature > 0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_id,
        eos_token_id=tokenizer.eos_id,
        **sampling,
    )
    encoded = [tokenizer.encode(p, add_bos=True) for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for length in sorted(by_length):
            members = by_length[length]
            for lo in range(0, len(members), batch_size):
                chunk = members[lo : lo + batch_size]
                ids = torch.from_numpy(np.stack([encoded[i] for i in chunk]).astype(np.int64))
                generated = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
                )
                for i, row in zip(chunk, generated[:, length:].tolist(), strict=True):
                    end = row.index(tokenizer.eos_id) if tokenizer.eos_id in row else len(row)
                    out[i] = tokenizer.decode(row[:end])
                if on_batch is not None:
                    on_batch(len(chunk))
    model.train(was_training)
    return out


def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    task: ArithmeticTask,
    n: int = 256,
    temperature: float = 1.0,
    *,
    start: int = 0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> float:
    """The fraction of problems ``start .. start + n`` of ``task`` whose sampled response
    has the right answer (:func:`extract_answer` equal to it, as the reward checks);
    ``on_batch`` as in :func:`sample_responses`."""
    problems = task.problems(n, start)
    if max_new_tokens is None:
        # room for a response twice the length of the longest target, then EOS
        max_new_tokens = 2 * max(len(solution_steps(p)) for p in problems) + 1
    responses = sample_responses(
        model,
        tokenizer,
        [p.prompt for p in problems],
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        on_batch=on_batch,
    )
    right = sum(extract_answer(r) == p.answer for r, p in zip(responses, problems, strict=True))
    return right / max(1, n)
