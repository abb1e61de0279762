"""``key=value`` overrides: dotted keys, YAML scalars, type checks, unknown keys."""

from __future__ import annotations

import pytest

from staleflow.config import ConfigError, RunConfig, load_config, parse_override


def test_dotted_overrides_reach_nested_sections():
    cfg = load_config(
        None,
        [
            "rollout.instances=4",
            "eta=0",
            "coordinator.routing=vanilla",
            "coordinator.cost_model.k1=1e-7",
            "coordinator.synchronization=drain",
        ],
    )
    assert cfg.rollout.instances == 4 and cfg.eta == 0
    assert cfg.coordinator.routing == "vanilla"
    assert cfg.coordinator.synchronization == "drain"
    assert cfg.coordinator.cost_model.k1 == 1e-7
    assert cfg.coordinator.cost_model.build().k1 == 1e-7
    # keys not overridden keep RunConfig's defaults, not CoordinatorConfig()'s
    assert cfg.coordinator.period_s == 0.2
    assert cfg.coordinator.cost_model.kv_budget == 16384.0


def test_values_follow_yaml_scalar_rules_and_field_types():
    cfg = load_config(
        None,
        [
            "trainer.lr=3e-5",  # PyYAML reads this as a string; float fields take it
            "rollout.temperature=1",  # an int where a float is expected
            "dashboard=yes",
            "model.warmup=false",
            "name=2024",  # a string field keeps the text YAML would read as an int
            "address=10:30",  # YAML 1.1 reads this as 630 (base 60)
            "data.tokenizer=",
        ],
    )
    assert cfg.trainer.lr == 3e-5
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.dashboard is True and cfg.model.warmup is False
    assert cfg.name == "2024" and cfg.address == "10:30"
    assert cfg.data.tokenizer == ""


def test_optional_values_reset_to_null():
    cfg = load_config(None, ["coordinator.cost_model.kv_budget=null"])
    assert cfg.coordinator.cost_model.kv_budget is None
    cfg = load_config(None, ["coordinator.cost_model.k2=0.002", "coordinator.cost_model.k2="])
    assert cfg.coordinator.cost_model.k2 is None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("dashboard=1", "dashboard=1 (an integer) has the wrong type: expected a boolean"),
        ("model.warmup=maybe", "expected a boolean (true or false)"),
        ("rollout.instances=two", "rollout.instances='two' (a string) has the wrong type"),
        ("rollout.instances=2.0", "write 2"),
        ("rollout.instances=true", "expected an integer"),
        ("trainer.lr=fast", "trainer.lr='fast' (a string) has the wrong type: expected a number"),
        ("trainer.lr=true", "expected a number"),
        ("coordinator.cost_model.k1=abc", "expected a number or null"),
        ("rollout.instances=[1, 2]", "(a list)"),
        ("eta=", "eta=None (null) has the wrong type: expected an integer"),
    ],
)
def test_wrong_types_name_the_expected_type(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("rollout.instance=4", "'rollout.instances'"),
        ("instances=4", "'rollout.instances'"),
        ("rollouts.instances=4", "'rollout.instances'"),
        ("coordinator.cost_model.k6=1", "'coordinator.cost_model.k5'"),
        ("coordinator.routng=vanilla", "'coordinator.routing'"),
        ("etaa=2", "'eta'"),
    ],
)
def test_unknown_keys_suggest_the_right_one(override, suggestion):
    with pytest.raises(ConfigError, match="unknown configuration key") as err:
        load_config(None, [override])
    assert f"did you mean {suggestion}" in str(err.value) or suggestion in str(err.value)


def test_unknown_key_without_a_close_match_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.zzzzzzz=1"])
    assert "valid keys here: kind, workers, timeout_s" in str(err.value)


def test_dashes_are_accepted_for_underscores():
    cfg = load_config(None, ["rollout.max-running=8", "trainer.micro-batch-size=4"])
    assert cfg.rollout.max_running == 8 and cfg.trainer.micro_batch_size == 4


def test_later_overrides_win():
    assert load_config(None, ["eta=1", "eta=2"]).eta == 2


def test_a_section_takes_a_mapping_and_keeps_its_other_defaults():
    cfg = load_config(None, ["coordinator={routing: vanilla, mu: 0.5}"])
    assert cfg.coordinator.routing == "vanilla" and cfg.coordinator.mu == 0.5
    assert cfg.coordinator.period_s == 0.2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["coordinator=vanilla"], "coordinator is a section, not a value"),
        (["eta"], "is not key=value"),
        (["=3"], "is not key=value"),
        (["rollout..instances=3"], "is not key=value"),
        (["eta=3", "eta.x=1"], "eta is set to 3 and also given keys"),
    ],
)
def test_malformed_overrides(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_parse_override_keeps_the_raw_text():
    assert parse_override("rollout.instances=4") == ("rollout.instances", 4, "4")
    assert parse_override(" address = a: b ") == ("address", {"a": "b"}, "a: b")
    # a string field takes the text even where YAML reads a mapping or fails to parse
    assert load_config(None, ["address=a: b"]).address == "a: b"
    assert load_config(None, ["address=[oops"]).address == "[oops"


def test_base_config_is_overridden():
    base = load_config(None, ["eta=0", "rollout.instances=3"])
    cfg = load_config(None, ["rollout.instances=5"], base=base)
    assert cfg.eta == 0 and cfg.rollout.instances == 5
    assert isinstance(cfg, RunConfig)
