"""The algorithm keys of the trainer (trainer.loss, loss_agg, kl_coef, kl_estimator,
trainer.ref): bad values are refused by the configuration, before Ray starts, with the
fix in the message; auto choices resolve as documented."""

from __future__ import annotations

import json

import pytest

from staleflow.config import ConfigError, RunConfig, config_warnings, load_config


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher reached ray.init with a value it should refuse")

    monkeypatch.setattr(ray, "init", refuse)


def _folders(tmp_path):
    """Paths that are not a model: missing, a file, a folder with no config.json, a
    config with no model_type, a config with no weights."""
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    untyped = tmp_path / "untyped"
    untyped.mkdir()
    (untyped / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (untyped / "model.safetensors").write_text("x")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return {
        tmp_path / "missing": "does not exist",
        a_file: "is not a directory",
        empty: r"is not a model folder \(no config.json\)",
        untyped: "no model_type",
        weightless: "has no weights",
    }


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.loss=grpo", r"trainer.loss='grpo' is unknown: use one of ppo \| gspo \| cispo"),
        ("trainer.loss_agg=mean", r"trainer.loss_agg='mean' is unknown: use one of auto"),
        ("trainer.kl_coef=-0.1", r"trainer.kl_coef=-0.1 must be >= 0 .* e.g. 0.001"),
        ("trainer.kl_estimator=k4", r"trainer.kl_estimator='k4' is unknown: use one of k1"),
        ("trainer.advantage=ppo", r"trainer.advantage='ppo' is unknown: use one of grpo"),
        ("trainer.loss_norm_len=-3", r"trainer.loss_norm_len=-3 is negative: use 0"),
        (
            "trainer.dynamic_sampling_max_drop=-0.5",
            r"trainer.dynamic_sampling_max_drop=-0.5 must be a share in \[0, 0.95\]",
        ),
        ("trainer.dynamic_sampling_max_drop=0.99", r"max_drop=0.99 is too large: use at most 0.95"),
    ],
)
def test_a_bad_algorithm_key_is_refused_before_ray_starts(override, expected, no_ray, capsys):
    from staleflow.cli import main

    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])
    assert main(["launch", "--no-dashboard", override]) == 2
    assert override.split("=")[0] in capsys.readouterr().err


def test_a_ref_path_that_is_not_a_model_is_refused_with_the_fix(tmp_path, no_ray, capsys):
    from staleflow.cli import main

    for path, why in _folders(tmp_path).items():
        with pytest.raises(ConfigError, match=why) as err:
            load_config(None, [f"trainer.ref.path={path}", "trainer.kl_coef=0.01"])
        assert "set it to a Hugging Face model folder" in str(err.value)
        assert "trainer.ref.path" in str(err.value)
    assert main(["launch", "--no-dashboard", f"trainer.ref.path={tmp_path / 'missing'}"]) == 2
    assert "trainer.ref.path" in capsys.readouterr().err


def test_a_model_folder_is_accepted_as_reference(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    cfg = load_config(None, [f"trainer.ref.path={tmp_path}", "trainer.kl_coef=0.01"])
    assert cfg.trainer.ref.path == str(tmp_path) and cfg.trainer.uses_reference


def test_dynamic_sampling_reaches_the_control_plane_only_when_on():
    assert load_config(None, []).sampling_config() is None
    on = load_config(None, ["trainer.dynamic_sampling=true", "batch_size=8"])
    sampling = on.sampling_config()
    assert sampling is not None and (sampling.batch_size, sampling.budget) == (8, 24)
    # at eta <= 1 a refill starts from nothing while the trainer waits: over-provision
    warned = config_warnings(load_config(None, ["trainer.dynamic_sampling=true", "eta=1"]))
    assert any("batch_redundancy of about p / (1 - p)" in w for w in warned)
    assert not any("batch_redundancy" in w for w in config_warnings(on))  # eta=3


def test_auto_aggregation_and_drgrpo_length():
    t = RunConfig().trainer
    assert t.aggregation(t.advantage) == "token_mean" and not t.uses_reference
    gspo = load_config(None, ["trainer.loss=gspo"]).trainer
    assert gspo.aggregation(gspo.advantage) == "seq_mean_token_mean"
    dr = load_config(None, ["trainer.advantage=drgrpo", "rollout.max_response_tokens=48"])
    assert dr.trainer.aggregation("drgrpo") == "seq_mean_token_sum_norm"
    assert dr.resolved().trainer.loss_norm_len == 48  # Dr. GRPO's L: the longest response
    explicit = load_config(None, ["trainer.advantage=drgrpo", "trainer.loss_agg=token_mean"])
    assert explicit.trainer.aggregation("drgrpo") == "token_mean"
    assert explicit.resolved().trainer is explicit.trainer  # no constant length needed
    assert load_config(None, ["trainer.kl_coef=0.01"]).trainer.uses_reference


def test_gspo_with_ppo_clip_ranges_warns():
    warned = config_warnings(load_config(None, ["trainer.loss=gspo"]))
    assert any("eps_low=3e-4 eps_high=4e-4" in w for w in warned)
    tuned = ["trainer.loss=gspo", "trainer.eps_low=3e-4", "trainer.eps_high=4e-4"]
    assert not any("gspo" in w for w in config_warnings(load_config(None, tuned)))


def test_a_ref_path_of_another_architecture_than_the_policy_is_refused(tmp_path, no_ray, capsys):
    from staleflow.cli import main

    def folder(name: str, **config) -> str:
        (tmp_path / name).mkdir()
        shape = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, **config}
        (tmp_path / name / "config.json").write_text(json.dumps(shape))
        (tmp_path / name / "model.safetensors").write_bytes(b"")
        return str(tmp_path / name)

    policy, same = folder("policy"), folder("same", torch_dtype="bfloat16")  # not a shape
    ok = load_config(None, [f"model.checkpoint={policy}", f"trainer.ref.path={same}"])
    assert ok.trainer.ref.path == same
    other = folder("other", hidden_size=32)
    override = f"trainer.ref.path={other}"
    with pytest.raises(ConfigError, match=r"hidden_size 32 \(reference\) vs 64 \(policy\)") as err:
        load_config(None, [f"model.checkpoint={policy}", override])
    assert "set it to a model folder of the policy's architecture" in str(err.value)
    assert main(["launch", "--no-dashboard", f"model.checkpoint={policy}", override]) == 2
    assert "trainer.ref.path" in capsys.readouterr().err
