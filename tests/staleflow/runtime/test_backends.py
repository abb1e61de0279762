"""The extension points of ``launch``: every registered backend hook has the documented
shape, and a backend without one (or not in its own registry) is refused by name. No
Ray."""

from __future__ import annotations

import inspect

import pytest

from staleflow.config import RunConfig, load_config
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
    ("override", "key"),
    [
        ("rollout.backend=sglang", "rollout.backend"),
        ("trainer.backend=megatron", "trainer.backend"),
    ],
)
def test_a_backend_without_a_hook_is_refused_naming_what_launch_builds(override, key):
    cfg = load_config(None, [override, "model.checkpoint=/models/m"])
    with pytest.raises(
        LaunchError, match=rf"{key}=\w+ is not implemented .*builds: embedded.*use {key}=embedded"
    ):
        backends.check_backends(cfg)


def test_a_hook_alone_is_not_enough_the_backend_registry_must_list_it(monkeypatch):
    # sglang is reserved in staleflow.engines.BACKENDS with no implementation yet
    monkeypatch.setitem(backends.ENGINE_BUILDERS, "sglang", "somewhere:build")
    cfg = load_config(None, ["rollout.backend=sglang", "model.checkpoint=/models/m"])
    with pytest.raises(LaunchError, match=r"rollout\.backend=sglang is not implemented"):
        backends.check_backends(cfg)


def test_the_registered_defaults_pass():
    backends.check_backends(RunConfig())
