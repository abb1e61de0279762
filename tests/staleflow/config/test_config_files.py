"""YAML files: loading, saving and the round trip."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from staleflow.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_file_then_overrides(tmp_path):
    path = _write(
        tmp_path,
        """
        eta: 1
        rollout:
          instances: 3
          temperature: 0.7
        coordinator:
          routing: vanilla
          cost_model:
            k1: 1e-7
        """,
    )
    cfg = load_config(path, ["rollout.instances=5"])
    assert cfg.eta == 1 and cfg.rollout.instances == 5 and cfg.rollout.temperature == 0.7
    assert cfg.coordinator.routing == "vanilla" and cfg.coordinator.cost_model.k1 == 1e-7
    assert cfg.coordinator.period_s == 0.2  # the rest of the section keeps RunConfig's default


def test_empty_file_and_empty_section_give_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == RunConfig()
    assert load_config(_write(tmp_path, "coordinator:\n")) == RunConfig()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- eta\n", "holds a list, not a mapping"),
        ("eta: [1\n", "is not valid YAML"),
        ("rollout:\n  instancse: 2\n", "did you mean 'rollout.instances'"),
        ("eta: three\n", "eta='three' (a string) has the wrong type: expected an integer"),
        ("name: 2024\n", "quote it in YAML files"),
        ("rollout: 4\n", "rollout is a section, not a value"),
        ("1: x\n", "is not a string"),
    ],
)
def test_bad_files(tmp_path, text, expected):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text))
    assert expected in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml")


def _custom() -> RunConfig:
    return load_config(
        None,
        [
            "eta=0",
            "name=null",  # strings YAML would read as something else must survive
            "address=10:30",
            "run_dir=1e-7",
            "model.cache_dir=yes",
            "model.checkpoint=/models/m",
            "data.task=gsm8k",
            "data.path=/data/g.jsonl",
            "trainer.lr=3e-6",
            "trainer.eps_high=0.2",
            "rollout.temperature=0.6",
            "coordinator.synchronization=drain",
            "coordinator.cost_model.k1=7.5e-8",
            "coordinator.cost_model.kv_budget=null",
        ],
    )


@pytest.mark.parametrize("make", [RunConfig, _custom])
def test_save_load_round_trip(tmp_path, make):
    cfg = make()
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    again = load_config(path)
    assert again == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert save_config(again, tmp_path / "again.yaml").read_text() == path.read_text()


def test_config_to_dict_is_plain_nested_data():
    data = config_to_dict(_custom())
    assert data["coordinator"]["cost_model"]["k1"] == 7.5e-8
    assert data["name"] == "null" and data["rollout"]["instances"] == 2
    assert yaml.safe_load(yaml.safe_dump(data)) == data
    assert config_to_dict(RunConfig().rollout)["backend"] == "embedded"
