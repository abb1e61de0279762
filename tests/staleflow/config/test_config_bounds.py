"""One definition per config bound: a redundancy ratio the run configuration accepts is
accepted by every component it reaches (the staleness manager, the trajectory server),
and one it refuses is refused by all of them. ``group_redundancy=12`` used to pass the
config and crash inside the control actor. No Ray."""

from __future__ import annotations

import re

import pytest

from staleflow.config import ConfigError, load_config
from staleness import InvalidConfig, StalenessConfig, StalenessManager
from trajectory_server.errors import InvalidConfig as TSInvalidConfig
from trajectory_server.types import TrajectoryServerConfig

VALUES = [-0.5, 0.0, 0.0625, 9.99, 10.0, 12.0, 15.5, 16.0, 100.0]


def _config_accepts(key: str, value: float) -> bool:
    try:
        load_config(None, [f"{key}={value}"])
    except ConfigError:
        return False
    return True


def _manager_accepts(key: str, value: float) -> bool:
    try:
        StalenessManager(StalenessConfig(eta=1, batch_size=2, group_size=4, **{key: value}))
    except InvalidConfig:
        return False
    return True


def _ts_accepts(key: str, value: float) -> bool:
    try:
        TrajectoryServerConfig(eta=1, batch_size=2, group_size=4, **{key: value})
    except TSInvalidConfig:
        return False
    return True


@pytest.mark.parametrize("key", ["group_redundancy", "batch_redundancy"])
@pytest.mark.parametrize("value", VALUES)
def test_every_component_agrees_on_the_redundancy_bound(key, value):
    verdicts = {
        "config": _config_accepts(key, value),
        "staleness manager": _manager_accepts(key, value),
        "trajectory server": _ts_accepts(key, value),
    }
    assert len(set(verdicts.values())) == 1, f"{key}={value}: {verdicts}"


def test_group_redundancy_12_that_the_config_accepts_builds_the_manager():
    cfg = load_config(None, ["group_redundancy=12"])
    manager = StalenessManager(
        StalenessConfig(
            eta=cfg.eta,
            batch_size=cfg.batch_size,
            group_size=cfg.group_size,
            group_redundancy=cfg.group_redundancy,
        )
    )
    assert manager.group_capacity == cfg.group_size * 13


def test_the_refusal_names_the_key_and_the_range_once_for_all():
    from staleness.bounds import REDUNDANCY_HINT

    hint = re.escape(REDUNDANCY_HINT)

    with pytest.raises(ConfigError, match=rf"group_redundancy=16.0 .*{hint}"):
        load_config(None, ["group_redundancy=16"])
    with pytest.raises(InvalidConfig, match=rf"batch_redundancy=16.0 .*{hint}"):
        StalenessManager(StalenessConfig(batch_redundancy=16.0))
    with pytest.raises(TSInvalidConfig, match=rf"group_redundancy=-1 .*{hint}"):
        TrajectoryServerConfig(group_redundancy=-1)
