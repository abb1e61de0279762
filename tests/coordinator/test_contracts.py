"""Every extension point, checked against every implementation: the real ones (runtime
and simulator), the test fakes, and deliberately broken ones the check must reject.

Structural typing is not checked at runtime, so this does it, as slime's plugin tests do:
the same methods with the same parameter names (extra ones need defaults), return
annotations the protocol's admits; and, for the data planes and the sources, the values
they really return when driven conform to the protocol's annotations.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
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
from staleflow.control import ControlLoop, Planes, TrajectoryStore
from staleflow.runtime.controller.actor import ControlActor
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.planes import RuntimePlanes
from staleflow.runtime.interface import ControlHandle, InstanceHandle
from staleflow.runtime.workers.actors import InstanceClient, RolloutActor
from staleflow.runtime.workers.control_client import WorkerControl
from staleflow.runtime.workers.instance_host import InstanceHost, RoutingServer
from staleflow.sim import SimCluster, tiny
from staleflow.sim.planes import SimPlanes
from staleness import StalenessManager
from staleness.interface import AdmissionControl
from staleness.types import TrajId
from tests.coordinator.fakes import FakeCluster
from trajectory_server import TrajectoryServer, TrajectoryServerApi
from trajectory_server.actor import TrajectoryServerClient

ABC_MODULES = ("collections.abc", "typing")  # their protocols support issubclass
SOURCES = (SnapshotSource, TrajectorySource, ParameterVersionSource)
PLANES = (EnginePlane, TrajectoryPlane, ParameterPlane, Planes)

CASES = [
    *[(p, impl) for p in SOURCES for impl in (ControlLoop, SimCluster, FakeCluster)],
    *[(p, impl) for p in PLANES for impl in (RuntimePlanes, SimPlanes, FakeCluster)],
    (TrajectoryServerApi, TrajectoryServer),
    (TrajectoryServerApi, TrajectoryServerClient),
    (TrajectoryStore, TrajectoryServer),
    (TrajectoryStore, TrajectoryServerClient),
    (RoutingServer, TrajectoryServer),
    (RoutingServer, TrajectoryServerClient),
    (InstanceHandle, InstanceHost),
    (InstanceHandle, InstanceClient),
    (InstanceHandle, RolloutActor),
    (ControlHandle, ControlPlane),
    (ControlHandle, WorkerControl),
    (ControlHandle, ControlActor),
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


# -- the static check ------------------------------------------------------------------


def _methods(protocol: type) -> dict[str, Any]:
    """Public methods and properties a protocol declares, its protocol bases included."""
    out: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                out[name] = value
    return out


def _returns(func: Callable[..., Any]) -> Any:
    try:
        return typing.get_type_hints(func).get("return", inspect.Signature.empty)
    except NameError as exc:  # an annotation that names nothing importable
        return f"<unresolvable: {exc}>"


def _show(hint: Any) -> str:
    if hint is type(None):
        return "None"
    return hint.__name__ if isinstance(hint, type) else str(hint)


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _admits(want: Any, got: Any) -> bool:
    """Is a declared return type ``got`` within the promised ``want``?"""
    if want is Any or want is object or got == want:
        return True
    if isinstance(got, str) or got is inspect.Signature.empty:
        return False
    if len(_members(got)) > 1:
        return all(_admits(want, g) for g in _members(got))
    if len(_members(want)) > 1:
        return any(_admits(w, got) for w in _members(want))
    w_origin, g_origin = typing.get_origin(want) or want, typing.get_origin(got) or got
    if not (isinstance(w_origin, type) and isinstance(g_origin, type)):
        return False
    if getattr(w_origin, "_is_protocol", False) and w_origin.__module__ not in ABC_MODULES:
        return all(hasattr(g_origin, name) for name in _methods(w_origin))  # structural
    if not issubclass(g_origin, w_origin):
        return False
    w_args = [a for a in typing.get_args(want) if a is not Ellipsis]
    g_args = [a for a in typing.get_args(got) if a is not Ellipsis]
    if not w_args or not g_args:
        return True
    return all(_admits(w, g) for w, g in zip(w_args, g_args, strict=False))


def violations(protocol: type, impl: type) -> list[str]:
    """Ways ``impl`` breaks ``protocol`` (empty when it follows it)."""
    out: list[str] = []
    for name, want in _methods(protocol).items():
        got = getattr(impl, name, None)
        if got is None:
            out.append(f"{impl.__name__} lacks {name}")
            continue
        if isinstance(want, property):
            if not isinstance(got, property):
                out.append(f"{impl.__name__}.{name} must be a property")
            continue
        w_params = list(inspect.signature(want).parameters.values())
        g_params = list(inspect.signature(got).parameters.values())
        w_names, g_names = [p.name for p in w_params], [p.name for p in g_params]
        if g_names[: len(w_names)] != w_names:
            out.append(f"{impl.__name__}.{name}{tuple(g_names)}: the protocol has {w_names}")
        for p in g_params[len(w_params) :]:
            variadic = p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            if p.default is p.empty and not variadic:
                out.append(f"{impl.__name__}.{name}: extra parameter {p.name} needs a default")
        w_ret, g_ret = _returns(want), _returns(got)
        if not _admits(w_ret, g_ret):
            out.append(
                f"{impl.__name__}.{name} returns {_show(g_ret)}, the protocol promises "
                f"{_show(w_ret)}"
            )
    return out


@pytest.mark.parametrize(("protocol", "impl"), CASES, ids=lambda x: getattr(x, "__name__", x))
def test_implementation_follows_protocol(protocol: type, impl: type) -> None:
    assert _methods(protocol), protocol
    assert violations(protocol, impl) == []


# -- deliberately broken implementations: the check must reject each -------------------


class SubmitReturnsNothing(SimPlanes):
    """The disagreement the simulator's planes once had with the runtime's."""

    def submit(  # type: ignore[override]
        self, inst: int, payloads: Mapping[TrajId, object], v_traj: Mapping[TrajId, int]
    ) -> None:
        super().submit(inst, payloads, v_traj)


class RenamedParameter(SimPlanes):
    def take(self, ids: Sequence[TrajId]) -> Mapping[TrajId, object]:  # type: ignore[override]
        return super().take(ids)


class ExtraRequiredParameter(SimPlanes):
    def pull(self, inst: int, at_least: int, force: bool) -> int:  # type: ignore[override]
        return super().pull(inst, at_least)


class WrongReturnType(SimPlanes):
    def abort(self, inst: int, trajs: Sequence[TrajId]) -> int:  # type: ignore[override]
        return len(super().abort(inst, trajs))


class NoRoutingView:
    def abort(self, traj_ids: Sequence[int]) -> tuple[object, ...]:
        return ()

    def abort_group(self, group_id: int) -> tuple[object, ...]:
        return ()


@pytest.mark.parametrize(
    ("protocol", "impl", "why"),
    [
        (EnginePlane, SubmitReturnsNothing, "submit returns None"),
        (TrajectoryPlane, RenamedParameter, r"take\('self', 'ids'\)"),
        (ParameterPlane, ExtraRequiredParameter, "force needs a default"),
        (EnginePlane, WrongReturnType, "abort returns int"),
        (TrajectoryStore, NoRoutingView, "lacks routing_view"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_a_broken_implementation_is_rejected(protocol: type, impl: type, why: str) -> None:
    found = violations(protocol, impl)
    assert found, f"{impl.__name__} passed the check of {protocol.__name__}"
    assert any(re.search(why, v) for v in found), found


# -- the behavioural check: real implementations, driven -------------------------------


def _conforms(value: Any, hint: Any) -> bool:
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    if len(_members(hint)) > 1:
        return any(_conforms(value, h) for h in _members(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if getattr(hint, "_is_protocol", False):
            return all(hasattr(value, name) for name in _methods(hint))
        return isinstance(value, hint)
    if not isinstance(value, origin):
        return False
    if not args:
        return True
    if issubclass(origin, Mapping):
        return all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return len(value) == len(args) and all(map(_conforms, value, args))
    return all(_conforms(v, args[0]) for v in value)


class Checked:
    """``impl`` with the return value of every ``protocol`` call checked."""

    def __init__(self, impl: object, *protocols: type) -> None:
        self._impl = impl
        self._hints = {
            name: _returns(method)
            for protocol in protocols
            for name, method in _methods(protocol).items()
            if not isinstance(method, property)
        }
        self.calls: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._impl, name)
        if name not in self._hints:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            value = attr(*args, **kwargs)
            hint = self._hints[name]
            assert _conforms(value, hint), (
                f"{type(self._impl).__name__}.{name} returned {value!r}, not {hint}"
            )
            self.calls.add(name)
            return value

        return call


def _drive_planes(planes: Any, ts: Any, inst: int) -> None:
    """Every data-plane call, as the executor makes them, on one initial group."""
    first = ts.routing_view()[0].group_id
    ids = [t.traj_id for t in ts.routing_view() if t.group_id == first][:2]
    taken = planes.take(ids)
    planes.give_back({ids[1]: taken[ids[1]]})  # a Reserve refused: the claim goes back
    planes.submit(inst, {ids[0]: taken[ids[0]]}, {ids[0]: 0})
    planes.give_back(planes.interrupt(inst, [ids[0]]))
    planes.submit(inst, planes.take([ids[0]]), {})  # the partial keeps its V_traj
    planes.abort(inst, [ids[0], ids[1]])
    planes.pull(inst, 0)


def _sim_world() -> tuple[SimCluster, Checked]:
    cluster = SimCluster(tiny(eta=1, steps=2))
    return cluster, Checked(cluster.planes, *PLANES)


def test_the_simulators_planes_and_sources_return_what_they_promise() -> None:
    cluster, planes = _sim_world()
    _drive_planes(planes, cluster.ts, 0)
    assert planes.calls == set(_methods(Planes))
    for source in (cluster, cluster.loop):
        checked = Checked(source, *SOURCES)
        checked.snapshot()
        checked.routable()
        checked.latest_version()
        assert checked.calls == {"snapshot", "routable", "latest_version"}


def test_the_runtimes_planes_and_sources_return_what_they_promise() -> None:
    from tests.staleflow.runtime.test_runtime_inprocess import wire

    w = wire(1)
    hosts = {i: Checked(h, InstanceHandle) for i, h in w.hosts.items()}
    for h in w.hosts.values():
        h.pull(0)
    planes = Checked(RuntimePlanes(hosts), *PLANES)  # type: ignore[arg-type]
    _drive_planes(planes, w.ts, 0)
    assert planes.calls == set(_methods(Planes))
    hosts[0].snapshot()
    assert {"snapshot", "route", "interrupt", "abort", "pull"} <= hosts[0].calls
    loop = Checked(w.control.loop, *SOURCES)
    loop.snapshot()
    loop.routable()
    loop.latest_version()
    assert loop.calls == {"snapshot", "routable", "latest_version"}
    store = Checked(w.ts, TrajectoryStore)
    assert store.abort([]) == ()
    assert isinstance(store.routing_view(), Collection)


def test_the_behavioural_check_rejects_a_plane_that_returns_the_wrong_thing() -> None:
    cluster = SimCluster(tiny(eta=1, steps=2))
    broken = SubmitReturnsNothing(
        cluster.instances,
        cluster.ts,
        cluster.workload.response_length,
        lambda: 0,
        lambda: 0.0,
    )
    with pytest.raises(AssertionError, match="submit returned None"):
        _drive_planes(Checked(broken, *PLANES), cluster.ts, 0)
    assert np.isfinite(cluster.now)
