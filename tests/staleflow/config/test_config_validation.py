"""Bad values fail with a message that names the dotted key and says how to fix it."""

from __future__ import annotations

import logging

import pytest

from coordinator.config import ConfigError as CoordinatorConfigError
from staleflow.config import (
    ConfigError,
    DataConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    config_warnings,
    load_config,
)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["eta=-1"], "eta=-1 is negative: use 0 for synchronous RL"),
        (["steps=0"], "steps=0 is too small: use at least 1"),
        (["seed=-5"], "seed=-5 is negative"),
        (["batch_size=0"], "batch_size=0 is too small: use at least 1 group"),
        (["group_size=0"], "group_size=0 is too small"),
        (["group_redundancy=-0.1"], "group_redundancy=-0.1 is out of range"),
        (["checkpoint_every=-1"], "checkpoint_every=-1"),
        (["dashboard_port=0"], "dashboard_port=0 is not a TCP port"),
        (["name=a/b"], "name='a/b' is not usable in a folder name"),
        (["run_dir="], "run_dir='' is empty"),
        (["model.preset=huge"], "model.preset='huge' is unknown: use one of"),
        (["model.warmup_steps=-1"], "model.warmup_steps=-1"),
        (["model.warmup_target=1.5"], "model.warmup_target=1.5 is not a share"),
        (["eval.problems=-1"], "eval.problems=-1 is too small"),
        (["eval.every=-5"], "eval.every=-5 is negative: use N >= 1"),
        (["eval.samples=0"], "eval.samples=0 is too small: use at least 1 response"),
        (["eval.samples=2", "eval.pass_k=3"], "eval.pass_k=3 is out of range: use 1 to eval"),
        (
            ["eval.every=5", "eval.problems=0"],
            "eval.problems=0 leaves nothing to evaluate every 5 steps: set eval.problems",
        ),
        (
            ["data.task=jsonl", "data.path=/d/t.jsonl", "model.checkpoint=/m", "eval.every=5"],
            "eval.path='' is required for eval.every=5 with data.task=jsonl",
        ),
        (
            ["data.task=calculator", "eval.every=5"],
            "eval.every=5 is not supported with data.task=calculator",
        ),
        (["data.task=csv"], "data.task='csv' is unknown: use one of arithmetic | gsm8k"),
        (["data.difficulty=9"], "data.difficulty=9 is out of range"),
        (["data.max_prompt_tokens=0"], "data.max_prompt_tokens=0"),
        (
            ["rollout.backend=tgi"],
            "rollout.backend='tgi' is unknown: use one of embedded | vllm | sglang",
        ),
        (["rollout.instances=0"], "rollout.instances=0 is too small: use at least 1"),
        (["rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
        (["rollout.top_p=1.5"], "rollout.top_p=1.5 is out of range: use (0, 1]"),
        (["rollout.max_running=0"], "rollout.max_running=0"),
        (["rollout.kv_budget_tokens=16"], "rollout.kv_budget_tokens=16 cannot hold"),
        (["rollout.max_response_tokens=4096"], "rollout.max_response_tokens=4096 does not fit"),
        (["reward.kind=llm"], "reward.kind='llm' is unknown: use one of auto"),
        (["reward.workers=0"], "reward.workers=0"),
        (["reward.timeout_s=-1"], "reward.timeout_s=-1.0 must be >= 0"),
        (["trainer.backend=deepspeed"], "trainer.backend='deepspeed' is unknown"),
        (["trainer.lr=0"], "trainer.lr=0.0 must be > 0, e.g. 1e-4"),
        (["trainer.lr=.inf"], "trainer.lr=inf must be > 0"),
        (["trainer.eps_low=1"], "trainer.eps_low=1.0 is out of range"),
        (["trainer.off_policy=ppo"], "trainer.off_policy='ppo' is unknown: use one of decoupled"),
        (["trainer.is_cap=0.5"], "trainer.is_cap=0.5 must be >= 1"),
        (["trainer.is_cap_mode=clip"], "trainer.is_cap_mode"),
        (["trainer.stall_timeout_s=-1"], "trainer.stall_timeout_s=-1.0 must be >= 0"),
        (["trainer.advantage=rloo"], "trainer.advantage='rloo' is unknown"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0 is too small"),
        (["parameter_server.transport=rdma"], "parameter_server.transport='rdma' is unknown"),
        (["parameter_server.num_slots=1"], "parameter_server.num_slots=1 is too small"),
        (["coordinator.mu=2"], "coordinator.mu=2.0 is out of range"),
        (["coordinator.routing=random"], "coordinator.routing='random' is unknown"),
        (["coordinator.cost_model.preset=a100"], "coordinator.cost_model.preset='a100'"),
        (
            ["coordinator.cost_model.k5=0"],
            "coordinator.cost_model.k5=0.0 must be a number > 0: use e.g.",
        ),
        # across sections
        (["data.task=gsm8k"], "data.path='' is required for data.task=gsm8k"),
        (["data.task=dapo", "data.path=d.parquet"], "model.checkpoint='' is required"),
        (["data.tokenizer=tok.json"], "data.tokenizer='tok.json' replaces the tokenizer"),
        (["data.task=jsonl", "data.path=d.parquet"], "data.path='d.parquet' does not end in"),
        (["data.path=train.jsonl"], "data.task=arithmetic does not read files"),
        (["rollout.vllm.extra_args=[1]"], "rollout.vllm.extra_args='[1]' is not a JSON object"),
        (["rollout.sglang.weight_sync=nccl"], "rollout.sglang.weight_sync='nccl' is unknown"),
        (["trainer.tp=2"], "trainer.tp=2 needs trainer.backend=megatron"),
        (
            ["trainer.backend=megatron", "trainer.tp=2", "trainer.ranks=8"],
            "trainer.ranks=8 does not equal trainer.dp x trainer.tp x trainer.pp = 1 x 2 x 1 "
            "= 2: set trainer.dp=4",
        ),
        (
            ["trainer.backend=megatron", "trainer.pp=2", "trainer.tp=2", "trainer.ranks=6"],
            "trainer.ranks=6 does not equal trainer.dp x trainer.tp x trainer.pp = 1 x 2 x 2 "
            "= 4: set trainer.ranks=0 (= dp x tp x pp) or change tp, pp, dp",
        ),
        (["trainer.pp=2"], "trainer.pp=2 needs trainer.backend=megatron"),
        (["trainer.load=ckpt"], "trainer.load='ckpt' is a Megatron checkpoint"),
        (
            ["trainer.stream=true", "trainer.updates_per_step=2"],
            "trainer.updates_per_step=2 must be 1 with trainer.stream",
        ),
        (["trainer.stream=maybe"], "trainer.stream"),
        (
            ["coordinator.race.enabled=true", "rollout.backend=sglang"],
            "coordinator.race.enabled=True with rollout.backend=sglang: the tail race needs "
            "copies that sample the original's tokens, which SGLang does only with "
            "deterministic inference; set rollout.sglang.deterministic=true",
        ),
        (["coordinator.race.copies=0"], "coordinator.race.copies=0 must be an integer >= 1"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)
    assert isinstance(err.value, ValueError)


def test_config_errors_are_the_coordinators_class():
    assert ConfigError is CoordinatorConfigError


def test_valid_file_task_and_cluster_backends():
    cfg = load_config(
        None,
        [
            "data.task=parquet",
            "data.path=/data/dapo.parquet",
            "model.checkpoint=/models/qwen",
            "rollout.backend=sglang",
            "trainer.backend=megatron",
            "rollout.max_response_tokens=20000",  # no built-in context limit with a checkpoint
        ],
    )
    assert cfg.resolved().reward.kind == "math_verify"
    tok = load_config(
        None,
        ["data.task=gsm8k", "data.path=g.jsonl", "model.checkpoint=/m", "data.tokenizer=tok.json"],
    )
    assert tok.data.tokenizer == "tok.json"


def test_direct_construction_checks_types_too():
    with pytest.raises(ConfigError, match=r"rollout.instances='4' \(a string\).*an integer"):
        RolloutConfig(instances="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"trainer\.lr=None"):
        TrainerConfig(lr=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"data=.*expected DataConfig"):
        RunConfig(data={"task": "gsm8k"})  # type: ignore[arg-type]
    assert DataConfig(difficulty=5).difficulty == 5
    assert RolloutConfig(temperature=1).temperature == 1  # an int is a valid float


def test_doubtful_settings_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="staleflow.config"):
        cfg = load_config(None, ["group_size=1", "rollout.kv_budget_tokens=8192"])
    text = caplog.text
    assert "group_size=1" in text and "coordinator.cost_model.kv_budget=16384" in text
    assert len(config_warnings(cfg)) == 2
    assert config_warnings(RunConfig()) == []


def test_the_tail_race_runs_on_the_embedded_engine():
    config = load_config(None, ["coordinator.race.enabled=true"])
    assert config.coordinator.race.enabled and config.rollout.backend == "embedded"


def test_the_tail_race_runs_on_sglang_with_deterministic_inference():
    config = load_config(
        None,
        [
            "coordinator.race.enabled=true",
            "rollout.backend=sglang",
            "rollout.sglang.deterministic=true",
        ],
    )
    assert config.coordinator.race.enabled and config.rollout.sglang.deterministic
