"""Held-out scoring before and after a run: its progress phase and its torch threads."""

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


def test_scoring_reports_its_problems_and_reward_on_the_idle_cores(monkeypatch):
    seen: dict = {}
    real = sampling.evaluate_accuracy

    def spy(*args, **kwargs):
        seen["threads"] = torch.get_num_threads()
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "evaluate_accuracy", spy)
    monkeypatch.setattr(threads, "idle_cores", lambda: 1)
    torch.set_num_threads(2)
    cfg = load_config(None, ["eval_problems=24", "rollout.max_response_tokens=4"])
    model, tokenizer = build_arithmetic_model("micro")
    progress = Progress()
    reward = held_out_reward(cfg, model, tokenizer, progress, "final")
    (state,) = progress.snapshot()
    assert (state.key, state.total, state.unit) == ("scoring", 24, "problems")
    assert state.label == "scoring the final policy on held-out problems"
    assert state.finished and state.done == 24 and state.metrics["reward"] == reward
    assert seen["threads"] == 1 and torch.get_num_threads() == 2  # restored after


def test_nothing_to_score_is_no_phase():
    cfg = load_config(None, ["eval_problems=0"])
    progress = Progress()
    assert held_out_reward(cfg, None, None, progress) is None
    assert progress.snapshot() == []
