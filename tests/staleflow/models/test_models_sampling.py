"""Sampling responses and scoring them on the built-in task."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.data.synthetic import ArithmeticConfig, ArithmeticTask  # noqa: E402
from staleflow.models import build_arithmetic_model  # noqa: E402
from staleflow.models import sampling as sampling_module  # noqa: E402
from staleflow.models.sampling import evaluate_accuracy, sample_responses  # noqa: E402

LEVEL1 = ArithmeticConfig.level(1)


def test_sampling_is_reproducible_and_accuracy_is_a_fraction():
    model, tokenizer = build_arithmetic_model("micro")
    prompts = ["1+2=", "13+4=", "7-8="]
    a = sample_responses(model, tokenizer, prompts, temperature=1.0, max_new_tokens=6, seed=3)
    b = sample_responses(model, tokenizer, prompts, temperature=1.0, max_new_tokens=6, seed=3)
    assert a == b and len(a) == 3 and all(len(r) <= 6 for r in a)
    greedy = sample_responses(model, tokenizer, prompts, temperature=0.0, max_new_tokens=6)
    assert greedy == sample_responses(model, tokenizer, prompts, temperature=0.0, max_new_tokens=6)
    with pytest.raises(ValueError, match="temperature"):
        sample_responses(model, tokenizer, prompts, temperature=-1.0)
    accuracy = evaluate_accuracy(model, tokenizer, ArithmeticTask(LEVEL1), n=16, temperature=1.0)
    assert 0.0 <= accuracy <= 1.0


def test_evaluate_accuracy_counts_right_answers(monkeypatch):
    model, tokenizer = build_arithmetic_model("micro")
    task = ArithmeticTask(LEVEL1)
    problems = task.problems(4)
    answers = [f"9+9={p.answer}" for p in problems[:3]] + ["nope"]
    monkeypatch.setattr(sampling_module, "sample_responses", lambda *a, **k: answers)
    assert evaluate_accuracy(model, tokenizer, task, n=4) == 0.75


def test_every_prompt_is_reported_once_batch_by_batch():
    model, tokenizer = build_arithmetic_model("micro")
    prompts = ["1+2=", "13+4=", "7-8=", "5+5=", "10-1="]  # lengths 5, 6, 5, 5, 6
    batches: list[int] = []
    sample_responses(
        model, tokenizer, prompts, max_new_tokens=3, batch_size=2, on_batch=batches.append
    )
    assert sorted(batches) == [1, 2, 2] and sum(batches) == len(prompts)
