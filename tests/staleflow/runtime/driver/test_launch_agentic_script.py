"""experiments/launch_agentic.py without a launch: each variant's configuration is one
``staleflow launch`` accepts (the sticky baseline's strategies included), and the
medians are taken per variant over its repeats."""

from __future__ import annotations

import pytest

from tests.support.experiments import load


@pytest.mark.parametrize("variant", ["eta0", "staleflow", "sticky", "staleflow+stream"])
def test_each_variant_is_a_valid_configuration_of_the_agentic_task(variant: str) -> None:
    from staleflow.config import load_config

    script = load("launch_agentic")
    eta, extra = script.VARIANTS[variant]
    # the script launches its own warmed-up policy (a micro model of 256 positions)
    policy = "model.checkpoint=/runs/policy"
    cfg = load_config(None, [*script.BASE, *extra, f"eta={eta}", "steps=2", policy])
    assert cfg.data.task == "calculator" and cfg.eta == eta
    assert cfg.env.latency_shape < 1.5  # heavier-tailed than the task's default
    routing = "sticky" if variant == "sticky" else "throughput"
    assert cfg.coordinator.routing == routing
    assert cfg.eval.problems > 0  # held-out success is scored at the start and the end
    assert cfg.trainer.stream == variant.endswith("+stream")  # only it streams


def test_medians_are_per_variant_over_the_repeats() -> None:
    script = load("launch_agentic")
    keys = ("episodes_per_s", "tool_wait_s", "tool_calls", "reward_end", "held_out_end")
    keys += ("trainer_idle_ratio", "rollout_idle_ratio")
    runs = [
        {"variant": v, "tokens_per_s": t, **dict.fromkeys(keys, 0.0)}
        for v, t in [("eta0", 1.0), ("sticky", 5.0), ("eta0", 3.0), ("eta0", 2.0)]
    ]
    med = script.medians(runs)
    assert med["eta0"]["tokens_per_s"] == 2.0 and med["eta0"]["repeats"] == 3
    assert med["sticky"]["tokens_per_s"] == 5.0
