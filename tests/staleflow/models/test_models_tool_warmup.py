"""The calculator task's warm-up: the loss covers the model's turns only, and the
multi-turn sampler plays whole episodes against the environment by the run's rule."""

from __future__ import annotations

import numpy as np
import pytest

from staleflow.envs import EpisodeLimits
from staleflow.envs.calculator import CalculatorEnvironment, calculator_samples, demonstration
from staleflow.envs.formats import PlainFormat
from staleflow.models.tool_warmup import (
    build_calculator_model,
    collate_demonstrations,
    play_episodes,
)
from staleflow.models.warmup import warmup


def test_the_labels_cover_the_model_turns_and_never_the_observation() -> None:
    _, tok = build_calculator_model("micro")
    fmt = PlainFormat(tok)
    demos = [demonstration(s, fmt, tok) for s in calculator_samples(size=3)]
    ids, labels, n = collate_demonstrations(demos, tok.pad_id)
    for i, d in enumerate(demos):
        start = len(d.prompt)
        trained = labels[i, start - 1 : start - 1 + len(d.response)].numpy()
        assert (trained >= 0).tolist() == d.mask.tolist()
        assert (trained[d.mask] == d.response[d.mask]).all()
        assert (labels[i, : start - 1] == -100).all()  # the prompt is context
        assert ids[i, start : start + len(d.response)].tolist() == d.response.tolist()
    assert n == sum(int(d.mask.sum()) for d in demos)


def test_episodes_are_played_to_their_end_by_the_runs_rule() -> None:
    model, tok = build_calculator_model("micro", seed=1)
    fmt = PlainFormat(tok)
    samples = calculator_samples(size=6)
    env = CalculatorEnvironment(latency_scale_s=0.0)
    limits = EpisodeLimits(max_turns=2, max_tokens=40)
    rewards = play_episodes(model, env, fmt, samples, limits, seed=3)
    assert len(rewards) == 6 and set(rewards) <= {0.0, 1.0}
    assert rewards == play_episodes(model, env, fmt, samples, limits, seed=3)  # seeded


def test_warmup_needs_a_task_or_batches() -> None:
    model, tok = build_calculator_model("micro")
    with pytest.raises(ValueError, match="needs a task, or batches"):
        warmup(model, tok, None, steps=1)
    assert np.isfinite(
        warmup(
            model, tok, None, steps=1, batch_size=2, log_every=0,
            batches=lambda step: collate_demonstrations(
                [demonstration(s, PlainFormat(tok), tok) for s in calculator_samples(size=2)],
                tok.pad_id,
            ),
        ).first_loss
    )  # fmt: skip


def test_a_changed_recipe_is_warmed_up_again_not_read_from_the_cache(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from staleflow.data.synthetic import ArithmeticConfig
    from staleflow.models.tool_warmup import ensure_warm_calculator_checkpoint

    def warm(**recipe: float) -> object:
        return ensure_warm_calculator_checkpoint(
            "micro", ArithmeticConfig.level(2), steps=1, batch_size=2, cache_dir=tmp_path,
            **recipe,
        )  # fmt: skip

    first = warm()
    assert warm() == first  # the same recipe: read back
    assert warm(lr=1e-3) != first
    assert warm(target_accuracy=0.5) != first
