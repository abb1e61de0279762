"""The extension points of ``launch``: every registered backend hook has the documented
shape, and a backend without one (or not in its own registry) is refused by name. No
Ray."""

from __future__ import annotations

import inspect
import sys
import types

import pytest

from staleflow.config import ModelConfig, RecoveryConfig, RunConfig, TrainerConfig, load_config
from staleflow.runtime import backends
from staleflow.runtime.errors import LaunchError


@pytest.mark.parametrize("name", sorted(backends.ENGINE_BUILDERS))
def test_every_engine_hook_takes_spec_seed_and_placement(name):
    hook = backends.load_hook(backends.engine_builder(name))
    assert list(inspect.signature(hook).parameters) == ["spec", "seed", "placement"]


@pytest.mark.parametrize("name", sorted(backends.TRAINER_POOLS))
def test_every_trainer_pool_hook_takes_its_context_spec_ps_control_and_recovery(name):
    entry = backends.trainer_backend(name)
    hook = backends.load_hook(entry.pool)
    params = list(inspect.signature(hook).parameters)
    assert params == ["ctx", "spec", "ps", "control", "recovery"]
    ranks = entry.ranks(RunConfig().trainer)
    assert isinstance(ranks, int) and ranks >= 1


@pytest.mark.parametrize(
    "name", sorted(n for n, entry in backends.TRAINER_POOLS.items() if entry.check)
)
def test_every_trainer_check_hook_takes_the_trainer_model_and_recovery_sections(name):
    hook = backends.load_hook(backends.trainer_backend(name).check)
    assert list(inspect.signature(hook).parameters) == ["trainer", "model", "recovery"]


def _check(cfg: RunConfig) -> None:
    """``check_backends`` with the sections ``launch`` hands it from the run plan."""
    backends.check_backends(cfg.rollout, cfg.trainer, cfg.model, cfg.recovery, address=cfg.address)


def test_a_trainer_check_refusal_is_a_launch_error_naming_its_key(monkeypatch):
    def refuse(trainer: TrainerConfig, model: ModelConfig, recovery: RecoveryConfig) -> None:
        raise ValueError(f"trainer.tp={trainer.tp} does not divide the heads")

    hooks = types.ModuleType("refusing_hooks")
    hooks.refuse = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "refusing_hooks", hooks)
    entry = backends.TrainerBackend(
        backends.TRAINER_POOLS["megatron"].pool, check="refusing_hooks:refuse"
    )
    monkeypatch.setitem(backends.TRAINER_POOLS, "megatron", entry)
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.tp=2"])
    with pytest.raises(LaunchError, match=r"^trainer\.tp=2 does not divide the heads$"):
        _check(cfg)


def test_a_backend_without_a_hook_is_refused_naming_what_launch_builds(monkeypatch):
    monkeypatch.delitem(backends.ENGINE_BUILDERS, "sglang")
    cfg = load_config(None, ["rollout.backend=sglang", "model.checkpoint=/models/m"])
    with pytest.raises(
        LaunchError,
        match=r"rollout\.backend=sglang is not implemented .*builds: embedded \| vllm.*"
        r"use rollout\.backend=embedded",
    ):
        _check(cfg)


def test_a_hook_alone_is_not_enough_the_backend_registry_must_list_it(monkeypatch):
    from staleflow import engines

    monkeypatch.setitem(engines.BACKENDS, "sglang", None)  # reserved, no implementation
    cfg = load_config(None, ["rollout.backend=sglang", "model.checkpoint=/models/m"])
    with pytest.raises(LaunchError, match=r"rollout\.backend=sglang is not implemented"):
        _check(cfg)


def test_an_engine_that_cannot_start_here_is_refused_by_key_before_anything_starts(tmp_path):
    # the engine's own preflight runs in check_backends: a missing model folder first ...
    cfg = load_config(None, ["rollout.backend=sglang", f"model.checkpoint={tmp_path}/none"])
    with pytest.raises(LaunchError, match=r"model\.checkpoint=.*config\.json"):
        _check(cfg)
    # ... then SGLang itself, which has no CPU build and is not installed here
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    cfg = load_config(None, ["rollout.backend=sglang", f"model.checkpoint={tmp_path}"])
    with pytest.raises(LaunchError, match=r"rollout\.backend=sglang: sglang is not installed"):
        _check(cfg)


def test_the_registered_defaults_pass():
    _check(RunConfig())
