"""The env section and data.task=calculator: bounds, and the response budget an
environment task gets when it is left at the arithmetic default."""

from __future__ import annotations

import pytest

from staleflow.config import ConfigError, load_config
from staleflow.config.env import (
    CALCULATOR_PRESET,
    CALCULATOR_RESPONSE_TOKENS,
    CALCULATOR_TRAINER_LR,
    ENV_RESPONSE_TOKENS,
)
from staleflow.models.presets import PRESETS


def test_an_environment_task_left_at_the_default_budget_gets_an_episodes_budget():
    cfg = load_config(None, ["data.task=calculator", "model.preset=micro"]).resolved()
    assert cfg.rollout.max_response_tokens == CALCULATOR_RESPONSE_TOKENS  # micro's context
    assert cfg.reward.kind == "exact"  # scored by the environment, not this
    mine = load_config(None, ["data.task=calculator", "rollout.max_response_tokens=100"])
    assert mine.resolved().rollout.max_response_tokens == 100
    ckpt = ["data.task=calculator", "model.checkpoint=/some/model"]
    assert load_config(None, ckpt).resolved().rollout.max_response_tokens == ENV_RESPONSE_TOKENS
    assert load_config(None, []).resolved().rollout.max_response_tokens == 32  # arithmetic
    assert cfg.env.options("calculator")["latency_scale_s"] == 0.05


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("env.max_turns=0", "env.max_turns"),
        ("env.latency_cap_s=0.01", "env.latency_cap_s"),
        ("env.latency_shape=0", "env.latency_shape"),
        ("env.step_timeout_s=-1", "env.step_timeout_s"),
        ("env.sandbox_memory_mb=8", "env.sandbox_memory_mb"),
    ],
)
def test_bad_env_values_are_refused_by_name(override, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["data.task=calculator", override])


def test_a_sandbox_needs_a_step_limit_and_reaches_the_workers_spec():
    from staleflow.runtime.driver.run_plan import plan_run

    with pytest.raises(ConfigError, match=r"env.step_timeout_s=0.0 must be > 0 with env.sandbox"):
        load_config(None, ["data.task=calculator", "env.sandbox=true", "env.step_timeout_s=0"])
    spec = plan_run(load_config(None, ["data.task=calculator", "env.sandbox=true"])).environment()
    assert spec is not None and spec.sandbox and spec.step_timeout_s == 60.0
    assert spec.sandbox_memory_mb == 1024
    more = ["data.task=calculator", "env.sandbox=true", "env.sandbox_memory_mb=4096"]
    spec = plan_run(load_config(None, more)).environment()
    assert spec is not None and spec.sandbox_memory_mb == 4096
    spec = plan_run(load_config(None, ["data.task=calculator"])).environment()
    assert spec is not None and not spec.sandbox  # off by default


def test_data_task_env_takes_the_environment_from_env_name(tmp_path):
    cfg = load_config(
        None,
        [
            "data.task=env",
            "env.name=mypkg.envs:MyEnv",
            f"data.path={tmp_path / 'problems.jsonl'}",
            f"model.checkpoint={tmp_path}",
        ],
    )
    assert cfg.env.environment(cfg.data.task) == "mypkg.envs:MyEnv"
    assert cfg.env.options("mypkg.envs:MyEnv") == {}  # built with its own defaults
    assert cfg.env.environment("calculator") == "calculator"
    resolved = cfg.resolved()
    assert resolved.reward.kind == "exact" and resolved.rollout.max_response_tokens == 256


def test_the_calculator_task_left_at_the_default_model_gets_the_model_that_learns_it():
    cfg = load_config(None, ["data.task=calculator"])
    assert cfg.model.preset == "auto"  # the default, as written
    resolved = cfg.resolved()
    assert resolved.model.preset == CALCULATOR_PRESET
    assert resolved.rollout.max_response_tokens == CALCULATOR_RESPONSE_TOKENS
    assert resolved.trainer.lr == CALCULATOR_TRAINER_LR
    mine = load_config(None, ["data.task=calculator", "trainer.lr=2e-4"]).resolved()
    assert mine.model.preset == CALCULATOR_PRESET and mine.trainer.lr == 2e-4
    arithmetic = load_config(None, []).resolved()
    assert arithmetic.model.preset == "tiny" and arithmetic.trainer.lr == cfg.trainer.lr
    # bos, "99*99+99=" and bos, "999*999-999*999=" (the levels' longest prompts)
    for level, longest_prompt in ((3, 10), (5, 17)):
        harder = load_config(None, ["data.task=calculator", f"data.difficulty={level}"])
        budget = harder.resolved().rollout.max_response_tokens
        assert budget < CALCULATOR_RESPONSE_TOKENS  # a longer prompt leaves less room
        assert budget + longest_prompt == PRESETS[CALCULATOR_PRESET].max_position_embeddings
    with_ckpt = load_config(None, ["data.task=calculator", "model.checkpoint=/m"]).resolved()
    assert with_ckpt.model.preset == "tiny"  # unused with a checkpoint
    # a preset given is the one used, with the learning rate given or its default
    tiny = load_config(None, ["data.task=calculator", "model.preset=tiny"]).resolved()
    assert tiny.model.preset == "tiny" and tiny.trainer.lr == arithmetic.trainer.lr
    assert tiny.rollout.max_response_tokens == 256  # the environment tasks' budget
    micro = load_config(None, ["data.task=calculator", "model.preset=micro"]).resolved()
    assert micro.model.preset == "micro" and micro.trainer.lr == arithmetic.trainer.lr


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["data.task=env", "data.path=p.jsonl", "model.checkpoint=m"], "env.name.*required"),
        (["data.task=env", "env.name=a:B", "model.checkpoint=m"], "data.path.*required"),
        (["data.task=env", "env.name=a:B", "data.path=p.jsonl"], "model.checkpoint.*required"),
        (["data.task=calculator", "env.name=a:B"], "env.name.*data.task=env"),
        (
            ["data.task=env", "env.name=mypkg.envs:", "data.path=p", "model.checkpoint=m"],
            "env.name",
        ),
    ],
)
def test_data_task_env_needs_its_environment_problems_and_policy(overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, overrides)
