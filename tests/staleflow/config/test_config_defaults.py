"""The defaults, the help text and what components get from the configuration."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.config import CoordinatorConfig
from staleflow.config import (
    ConfigKey,
    RewardConfig,
    RunConfig,
    describe_config,
    format_config_help,
    load_config,
)
from staleflow.config.walk import iter_keys
from trajectory_server.types import TrajectoryServerConfig


def test_defaults_are_the_documented_embedded_run():
    cfg = RunConfig()
    assert (cfg.eta, cfg.steps, cfg.seed, cfg.batch_size, cfg.group_size) == (3, 200, 0, 32, 8)
    assert (cfg.run_dir, cfg.name, cfg.address) == ("runs", "", "")
    assert (cfg.dashboard, cfg.dashboard_port) == (True, 8266)  # 8265 is Ray's dashboard
    assert cfg.model.preset == "auto" and cfg.model.checkpoint == "" and cfg.model.warmup
    assert cfg.resolved().model.preset == "tiny"  # auto, for the built-in arithmetic task
    assert cfg.data.task == "arithmetic" and cfg.data.path == ""
    assert cfg.rollout.backend == "embedded" and cfg.rollout.instances == 2
    assert cfg.trainer.backend == "embedded" and cfg.trainer.off_policy == "decoupled"
    assert cfg.reward.kind == "auto" and cfg.parameter_server.transport == "auto"
    assert load_config(None, []) == cfg


def test_embedded_coordinator_default_leaves_the_class_default_alone():
    assert RunConfig().coordinator.period_s == 0.2
    assert RunConfig().coordinator.cost_model.kv_budget == RunConfig().rollout.kv_budget_tokens
    assert CoordinatorConfig().period_s == 1.0  # the cluster default others depend on
    assert CoordinatorConfig().cost_model.kv_budget is None


def test_the_control_plane_plans_for_the_rollouts_response_cap():
    from staleflow.runtime.driver.run_plan import plan_run

    cfg = load_config(None, ["rollout.max_response_tokens=64"])
    assert plan_run(cfg).control.coordinator.fill_steps == 64  # headroom: one whole response
    budget = ["rollout.kv_budget_tokens=65536", "coordinator.cost_model.kv_budget=65536"]
    own = ["model.checkpoint=/models/m", "rollout.max_response_tokens=8000", *budget]
    long = load_config(None, own)  # (the built-in model's context is shorter)
    assert plan_run(long).control.coordinator.fill_steps == CoordinatorConfig().fill_steps


def test_sections_are_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.instances = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eta = 1  # type: ignore[misc]


def test_every_staleflow_key_has_help():
    missing = [
        key
        for key, _, f in iter_keys(RunConfig)
        if not key.startswith("coordinator.cost_model.k") and not f.metadata.get("help")
    ]
    assert missing == []


def test_describe_lists_keys_defaults_and_help():
    keys = {k.key: k for k in describe_config()}
    assert keys["rollout.instances"] == ConfigKey(
        "rollout.instances", "int", 2, keys["rollout.instances"].help
    )
    assert keys["coordinator.period_s"].default == 0.2  # RunConfig's default, not the class's
    assert keys["coordinator.cost_model.k1"].type == "float | None"
    assert "synchronous" in keys["eta"].help
    text = format_config_help()
    assert len(text.splitlines()) == len(keys)
    (lr_line,) = [line for line in text.splitlines() if line.startswith("trainer.lr ")]
    assert "5.0e-05" in lr_line and "learning rate" in lr_line
    assert "coordinator.cost_model.kv_budget" in text


def test_resolved_picks_the_reward_for_the_task():
    assert RunConfig().resolved().reward.kind == "arithmetic"
    gsm = load_config(None, ["data.task=gsm8k", "data.path=g.jsonl", "model.checkpoint=/m"])
    assert gsm.resolved().reward.kind == "math_verify"
    assert gsm.resolved().data == gsm.data
    explicit = load_config(None, ["reward.kind=exact", "model.preset=tiny"])
    assert explicit.resolved() is explicit
    assert RewardConfig(kind="exact").kind == "exact"


def test_trajectory_server_gets_the_top_level_keys():
    cfg = load_config(None, ["eta=1", "batch_size=4", "group_size=2", "group_redundancy=0.5"])
    ts = cfg.trajectory_server_config()
    assert isinstance(ts, TrajectoryServerConfig)
    assert (ts.eta, ts.batch_size, ts.group_size, ts.trajectories_per_group) == (1, 4, 2, 3)
