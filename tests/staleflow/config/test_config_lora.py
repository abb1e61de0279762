"""``trainer.lora``: what needs no model is refused by the configuration, before anything
starts, with the fix (rank 0, bad module names, a trainer or rollout backend that cannot
train or load adapters); the defaults leave LoRA off."""

from __future__ import annotations

import pytest

from staleflow.config import ConfigError, load_config
from staleflow.config.lora import DEFAULT_TARGETS, LoraConfig
from staleflow.config.rollout import LORA_ROLLOUT_BACKENDS, ROLLOUT_BACKENDS

ON = "trainer.lora.enabled=true"


def test_lora_is_off_by_default_with_the_decoder_linear_layers_as_targets():
    lora = load_config(None, []).trainer.lora
    assert not lora.enabled
    assert lora.targets == tuple(DEFAULT_TARGETS.split(","))
    assert LoraConfig(rank=8, alpha=16.0).scaling == 2.0
    on = load_config(None, [ON, "trainer.lora.target_modules= q_proj, v_proj,q_proj"])
    assert on.trainer.lora.targets == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.lora.rank=0"], r"trainer.lora.rank=0 .*e.g. 16.*trainer.lora.enabled=false"),
        (["trainer.lora.alpha=0"], r"trainer.lora.alpha=0.0 must be > 0"),
        (["trainer.lora.dropout=1.0"], r"trainer.lora.dropout=1.0 is out of range: use \[0, 1\)"),
        (["trainer.lora.target_modules=,"], r"target_modules=',' must name linear layers"),
        (["trainer.lora.target_modules=q_proj,mlp.0"], r"'mlp.0' is not a module name"),
        (
            ["trainer.backend=megatron"],
            r"trainer.lora.enabled=True needs trainer.backend=embedded: the Megatron trainer "
            r"has no adapters.*set trainer.backend=embedded, or trainer.lora.enabled=false",
        ),
    ],
)
def test_bad_lora_settings_are_refused_with_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [ON, *overrides])


def test_a_rollout_backend_that_cannot_load_adapters_is_refused(monkeypatch):
    # every built-in backend loads adapters now; a backend that could not (a new one, or
    # one whose LoRA is turned off here) is refused at start with the fix
    monkeypatch.setattr("staleflow.config.run.LORA_ROLLOUT_BACKENDS", ("embedded",))
    with pytest.raises(
        ConfigError,
        match=r"rollout.backend='vllm' cannot load a LoRA.*use rollout.backend=embedded",
    ):
        load_config(None, [ON, "rollout.backend=vllm"])
    load_config(None, ["rollout.backend=vllm"])  # without LoRA it is fine


def test_every_lora_backend_loads():
    assert set(LORA_ROLLOUT_BACKENDS) <= set(ROLLOUT_BACKENDS)
    for backend in LORA_ROLLOUT_BACKENDS:
        assert load_config(None, [ON, f"rollout.backend={backend}"]).trainer.lora.enabled
