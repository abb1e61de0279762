"""Every extension point of the coordinator, checked against its implementations:
same methods, same parameter names (structural typing is not checked at runtime)."""

from __future__ import annotations

import inspect

import pytest

from coordinator import (
    AdmissionSource,
    CommandExecutor,
    EnginePlane,
    InProcessExecutor,
    ParameterPlane,
    ParameterVersionSource,
    SnapshotSource,
    TrajectoryPlane,
    TrajectorySource,
)
from coordinator.migration import NoMigration, ThroughputMigration
from coordinator.routing import ThroughputRouting
from coordinator.strategies import MigrationStrategy, RoutingStrategy, SyncStrategy
from coordinator.sync import GreedySync, ThroughputSync
from coordinator.vanilla_routing import LeastLoadedRouting
from staleness import StalenessManager
from staleness.interface import AdmissionControl
from tests.coordinator.fakes import FakeCluster

CASES = [
    (SnapshotSource, FakeCluster),
    (TrajectorySource, FakeCluster),
    (ParameterVersionSource, FakeCluster),
    (EnginePlane, FakeCluster),
    (TrajectoryPlane, FakeCluster),
    (ParameterPlane, FakeCluster),
    (AdmissionSource, StalenessManager),
    (AdmissionControl, StalenessManager),
    (CommandExecutor, InProcessExecutor),
    (RoutingStrategy, ThroughputRouting),
    (RoutingStrategy, LeastLoadedRouting),
    (SyncStrategy, ThroughputSync),
    (SyncStrategy, GreedySync),
    (MigrationStrategy, ThroughputMigration),
    (MigrationStrategy, NoMigration),
]


def _methods(protocol: type) -> list[str]:
    return [
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]


@pytest.mark.parametrize(("protocol", "impl"), CASES, ids=lambda x: getattr(x, "__name__", x))
def test_implementation_follows_protocol(protocol: type, impl: type) -> None:
    names = _methods(protocol)
    assert names, protocol
    for name in names:
        want = getattr(protocol, name)
        got = getattr(impl, name, None)
        assert got is not None, f"{impl.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} must be a property"
            continue
        params = list(inspect.signature(want).parameters)
        assert list(inspect.signature(got).parameters)[: len(params)] == params, name
