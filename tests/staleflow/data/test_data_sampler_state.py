"""The prompt sampler's saved position: a resumed sampler draws exactly what the original
would have drawn next, and a different dataset or a corrupt state is refused."""

from __future__ import annotations

import pytest

from staleflow.data import ALPHABET, CharTokenizer, PromptSampler, synthetic_dataset
from trajectory_server import ResumableSource


def draw(sampler: PromptSampler, n: int) -> list[int | None]:
    out = []
    for _ in range(n):
        s = sampler.next_sample()
        out.append(None if s is None else s.sample_id)
    return out


def test_resumed_sampler_continues_the_same_sequence_across_epochs():
    ds = synthetic_dataset(CharTokenizer(ALPHABET), size=7)
    original = PromptSampler(ds, seed=11, max_epochs=3)
    draw(original, 9)
    state = original.state()
    assert state == {"drawn": 9, "seed": 11, "shuffle": True, "max_epochs": 3, "dataset_size": 7}
    resumed = PromptSampler.from_state(ds, state)
    assert draw(resumed, 14) == draw(original, 14)  # to the end of the last epoch and past it
    assert resumed.next_sample() is None and isinstance(resumed, ResumableSource)


def test_from_state_refuses_another_dataset_or_a_broken_state():
    ds = synthetic_dataset(CharTokenizer(ALPHABET), size=7)
    state = PromptSampler(ds, seed=1).state()
    with pytest.raises(ValueError, match="dataset_size: the run sampled from 7 prompts"):
        PromptSampler.from_state(synthetic_dataset(CharTokenizer(ALPHABET), size=8), state)
    with pytest.raises(ValueError, match="'seed'"):
        PromptSampler.from_state(ds, {k: v for k, v in state.items() if k != "seed"})
    with pytest.raises(ValueError, match="drawn"):
        PromptSampler.from_state(ds, {**state, "drawn": "9"})
    with pytest.raises(ValueError, match="negative"):
        PromptSampler.from_state(ds, {**state, "drawn": -1})
