"""The env section and data.task=calculator: bounds, and the response budget an
environment task gets when it is left at the arithmetic default."""

from __future__ import annotations

import pytest

from staleflow.config import ConfigError, load_config
from staleflow.config.env import ENV_RESPONSE_TOKENS


def test_an_environment_task_left_at_the_default_budget_gets_an_episodes_budget():
    cfg = load_config(None, ["data.task=calculator"]).resolved()
    assert cfg.rollout.max_response_tokens == ENV_RESPONSE_TOKENS
    assert cfg.reward.kind == "exact"  # scored by the environment, not this
    mine = load_config(None, ["data.task=calculator", "rollout.max_response_tokens=100"])
    assert mine.resolved().rollout.max_response_tokens == 100
    assert load_config(None, []).resolved().rollout.max_response_tokens == 32  # arithmetic
    assert cfg.env.options("calculator")["latency_scale_s"] == 0.05


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("env.max_turns=0", "env.max_turns"),
        ("env.latency_cap_s=0.01", "env.latency_cap_s"),
        ("env.latency_shape=0", "env.latency_shape"),
        ("env.step_timeout_s=-1", "env.step_timeout_s"),
    ],
)
def test_bad_env_values_are_refused_by_name(override, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["data.task=calculator", override])
