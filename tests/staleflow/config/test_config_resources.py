"""The ``resources`` section and the cluster keys: what each pool asks for, bad values
refused naming the key and the fix, YAML round trip."""

from __future__ import annotations

import pytest

from staleflow.config import ConfigError, RunConfig, load_config, save_config


def test_defaults_ask_one_cpu_per_member_on_any_node():
    res = RunConfig().resources
    for pool in (res.rollout, res.trainer, res.reward, res.parameter_server, res.control):
        assert pool.cpus == 1.0 and pool.node_resource == "" and pool.node_label == ""
    assert res.rollout.gpus == res.trainer.gpus == res.reward.gpus == 0.0
    assert not hasattr(res.parameter_server, "gpus") and not hasattr(res.control, "gpus")
    assert RunConfig().rollout.tensor_parallel == 1
    assert RunConfig().parameter_server.push_transport == "auto"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("resources.rollout.cpus=-1", "resources.rollout.cpus=-1.0 must be >= 0 CPU cores"),
        ("resources.trainer.gpus=-2", "resources.trainer.gpus=-2.0 must be >= 0 GPUs"),
        (
            "resources.reward.node_resource=CPU",
            "resources.reward.node_resource='CPU' is not a custom",
        ),
        (
            "resources.control.node_resource=a b",
            "resources.control.node_resource='a b' is not a custom",
        ),
        (
            "resources.rollout.node_label=rollout",
            "resources.rollout.node_label='rollout' is not KEY=VALUE",
        ),
        ("resources.rollout.node_label=ray.io/node-id=x", "(ray.io/ labels are Ray's own)"),
        ("resources.placement_timeout_s=0", "resources.placement_timeout_s=0.0 must be > 0"),
        ("rollout.tensor_parallel=0", "rollout.tensor_parallel=0 is too small"),
        ("rollout.tensor_parallel=2", "needs a tensor-parallel engine"),
        (
            "parameter_server.push_transport=shm",
            "push_transport='shm' is unknown: use one of auto | nixl | socket",
        ),
        (
            "resources.parameter_server.gpus=1",
            "unknown configuration key 'resources.parameter_server.gpus'",
        ),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override, expected):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    assert expected in str(refused.value)


def test_pools_pin_to_node_groups_and_survive_a_yaml_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "resources.rollout.gpus=1",
            "resources.rollout.node_label=staleflow.io/pool=rollout",
            "resources.trainer.node_resource=staleflow_trainer",
            "resources.parameter_server.cpus=0.5",
            "rollout.backend=sglang",
            "model.checkpoint=/models/m",
            "rollout.tensor_parallel=4",
        ],
    )
    assert cfg.resources.rollout.node_label == "staleflow.io/pool=rollout"
    assert cfg.resources.trainer.node_resource == "staleflow_trainer"
    assert cfg.rollout.tensor_parallel == 4
    assert load_config(save_config(cfg, tmp_path / "run.yaml"), []) == cfg


def test_one_tensor_parallel_key_sizes_the_vllm_engine(tmp_path):
    # rollout.vllm.tensor_parallel_size and rollout.tensor_parallel were never checked
    # against each other: the generic key is the one, and the other names it
    with pytest.raises(
        ConfigError,
        match=r"rollout\.vllm\.tensor_parallel_size is no longer a key: .*set "
        r"rollout\.tensor_parallel instead",
    ):
        load_config(None, ["rollout.backend=vllm", "rollout.vllm.tensor_parallel_size=2"])
    from staleflow.engines.factory import engine_options

    cfg = load_config(None, ["rollout.backend=vllm", "rollout.tensor_parallel=2"])
    options = engine_options(cfg.rollout, checkpoint=str(tmp_path), run_dir=tmp_path)
    assert options.tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel=2 needs a tensor-parallel"):
        load_config(None, ["rollout.tensor_parallel=2"])  # the embedded engine
