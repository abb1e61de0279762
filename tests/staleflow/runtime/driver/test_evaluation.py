"""Held-out scoring before and after a run: its progress phase and its torch threads; the
held-out set the evaluation during training samples is the same problem stream."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.config import load_config  # noqa: E402
from staleflow.models import (  # noqa: E402
    build_arithmetic_model,
    sampling,
    threads,
)
from staleflow.progress import Progress  # noqa: E402
from staleflow.runtime.driver.evaluation import held_out_reward  # noqa: E402
from staleflow.runtime.driver.run_plan import RunPlan, plan_run  # noqa: E402


def _plan(*overrides: str) -> RunPlan:
    return plan_run(load_config(None, list(overrides)))


def test_scoring_reports_its_problems_and_reward_on_the_idle_cores(monkeypatch):
    seen: dict = {}
    real = sampling.evaluate_accuracy

    def spy(*args, **kwargs):
        seen["threads"] = torch.get_num_threads()
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "evaluate_accuracy", spy)
    monkeypatch.setattr(threads, "idle_cores", lambda: 1)
    torch.set_num_threads(2)
    plan = _plan("eval.problems=24", "rollout.max_response_tokens=4")
    model, tokenizer = build_arithmetic_model("micro")
    progress = Progress()
    reward = held_out_reward(plan.task, plan.rollout, model, tokenizer, progress, "final")
    (state,) = progress.snapshot()
    assert (state.key, state.total, state.unit) == ("scoring", 24, "problems")
    assert state.label == "scoring the final policy on held-out problems"
    assert state.finished and state.done == 24 and state.metrics["reward"] == reward
    assert seen["threads"] == 1 and torch.get_num_threads() == 2  # restored after


def test_nothing_to_score_is_no_phase():
    for off in (["eval.problems=0"], ["eval.path=/data/test.jsonl"]):  # a user's set: no CPU score
        plan = _plan(*off)
        progress = Progress()
        assert held_out_reward(plan.task, plan.rollout, None, None, progress) is None
        assert progress.snapshot() == []


def test_the_built_in_held_out_set_is_the_stream_the_start_and_end_scores_sample(monkeypatch):
    from staleflow.runtime.driver.evaluation import heldout_set

    plan = _plan("eval.problems=5", "eval.every=2", "seed=3")
    _, tokenizer = build_arithmetic_model("micro")
    seen: dict = {}

    def spy(model, tok, task, n, *args, **kwargs):
        seen["problems"] = task.problems(n)
        return 0.5

    monkeypatch.setattr(sampling, "evaluate_accuracy", spy)
    assert held_out_reward(plan.task, plan.rollout, None, tokenizer) == 0.5
    heldout = heldout_set(plan.task, tokenizer)
    assert heldout is not None and len(heldout) == 5
    for sample, problem in zip(heldout, seen["problems"], strict=True):
        assert tokenizer.decode(sample.prompt_ids) == problem.prompt
        assert sample.answer == problem.answer
    assert heldout_set(_plan("eval.every=0").task, tokenizer) is None  # off
