"""The TS API is written three times: the core (``TrajectoryServer``), the bytes service
the Ray actor runs and its client. One protocol, ``TrajectoryServerApi``, holds it; this
checks each of the three against it (the same methods, with the same parameter names,
kinds and defaults), every caller's narrower protocol against it, and then drives one
scenario through the core and through the client over the service (an in-process handle:
every message packed and unpacked, no Ray), which must answer alike."""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from staleflow.control.late import (
    CompletionSink,
    PartialSink,
    RewardHandOff,
    TurnSink,
)
from staleflow.control.loop import TrajectoryStore
from staleflow.runtime.controller.control_plane import CheckpointStore
from staleflow.runtime.controller.races import RaceServer
from staleflow.runtime.controller.tool_view import ToolWaitSource
from staleflow.runtime.driver.supervised import RewardLedger
from staleflow.runtime.workers.env_stage import EnvServer
from staleflow.runtime.workers.instance_host import RoutingServer
from staleflow.runtime.workers.sibling_drafts import SiblingServer
from staleflow.trainers.interface import BatchSource
from tests.trajectory_server.conftest import CycleSource, _response, in_process_client
from trajectory_server import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    NextTurn,
    PartialTrajectory,
    TrainingBatch,
    TrajectoryServer,
    TrajectoryServerConfig,
)
from trajectory_server.actor import TrajectoryServerClient, TrajectoryServerService
from trajectory_server.api import IN_PROCESS_ONLY, TrajectoryServerApi

# the service's calls that take one packed wire message (``wire.py``) instead of the
# API's parameters; the others take the API's parameters as plain values
PACKED = {
    "route",
    "interrupt_return",
    "complete_many",
    "report_progress",
    "group_responses",
    "hand_to_reward",
    "next_turn",
}
# API calls the client builds on another call of the service, and which one
CLIENT_BUILT = {"complete": "complete_many"}

AUDIENCES = (
    RoutingServer,
    SiblingServer,
    EnvServer,
    ToolWaitSource,
    RaceServer,
    CheckpointStore,  # with RecoverableStore, TrajectoryStore, Aborter, GroupFilterSink
    TrajectoryStore,
    CompletionSink,
    PartialSink,
    RewardHandOff,
    TurnSink,
    BatchSource,
    RewardLedger,
)

Shape = list[tuple[str, Any, Any]]


def _api(protocol: type) -> dict[str, Callable[..., Any]]:
    """The methods a protocol declares, its protocol bases' included."""
    out: dict[str, Callable[..., Any]] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        out |= {n: v for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}
    return out


def _public(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and _is_method(v)}


def _is_method(value: object) -> bool:
    return callable(value) or isinstance(value, (property, classmethod, staticmethod))


def _shape(func: Callable[..., Any]) -> Shape:
    """Each parameter's name, kind and default (``self`` left out)."""
    params = list(inspect.signature(func).parameters.values())[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def _mismatches(impl: type, names: Mapping[str, Callable[..., Any]] | None = None) -> list[str]:
    """Where ``impl``'s methods differ from the API's in parameters or return type."""
    out = []
    for name, want in (names or _api(TrajectoryServerApi)).items():
        got = getattr(impl, name, None)
        if got is None:
            out.append(f"{impl.__name__} lacks {name}")
            continue
        if _shape(got) != _shape(want):
            out.append(f"{impl.__name__}.{name}{_shape(got)}: the API has {_shape(want)}")
        w_ret, g_ret = _returns(want), _returns(got)
        if not _within(w_ret, g_ret):
            out.append(f"{impl.__name__}.{name} returns {g_ret}, the API {w_ret}")
    return out


def _returns(func: Callable[..., Any]) -> Any:
    return typing.get_type_hints(func)["return"]


def _within(want: Any, got: Any) -> bool:
    """``got`` is ``want``, or a subclass of its container with the same contents."""
    if got == want:
        return True
    w_origin, g_origin = typing.get_origin(want), typing.get_origin(got)
    if not (isinstance(w_origin, type) and isinstance(g_origin, type)):
        return False
    args = [[a for a in typing.get_args(t) if a is not Ellipsis] for t in (want, got)]
    return issubclass(g_origin, w_origin) and args[0] == args[1]


# -- the static check ------------------------------------------------------------------


def test_every_public_method_of_the_core_is_in_the_api_or_named_in_process_only() -> None:
    api = set(_api(TrajectoryServerApi))
    assert not api & set(IN_PROCESS_ONLY), "a name cannot be both"
    assert _public(TrajectoryServer) == api | set(IN_PROCESS_ONLY)


@pytest.mark.parametrize("impl", [TrajectoryServer, TrajectoryServerClient])
def test_the_core_and_the_client_follow_the_api(impl: type) -> None:
    assert _mismatches(impl) == []


def test_the_client_has_nothing_beyond_the_api() -> None:
    assert _public(TrajectoryServerClient) == set(_api(TrajectoryServerApi))


def test_the_service_carries_every_call_of_the_api() -> None:
    api = _api(TrajectoryServerApi)
    assert _public(TrajectoryServerService) == set(api) - set(CLIENT_BUILT)
    assert set(CLIENT_BUILT.values()) <= set(api)
    for name in set(api) - set(CLIENT_BUILT):
        got = _shape(getattr(TrajectoryServerService, name))
        if name in PACKED:  # one packed message, whatever the API's parameters
            assert len(got) == 1 and got[0][1] == "POSITIONAL_OR_KEYWORD", name
            param = inspect.signature(getattr(TrajectoryServerService, name)).parameters
            assert param[got[0][0]].annotation == "bytes", name
        else:
            assert got == _shape(api[name]), name


@pytest.mark.parametrize("audience", AUDIENCES, ids=lambda p: p.__name__)
def test_each_callers_protocol_is_part_of_the_api(audience: type) -> None:
    api = _api(TrajectoryServerApi)
    methods = _api(audience)
    assert methods and set(methods) <= set(api), set(methods) - set(api)
    for name, method in methods.items():
        assert _shape(method) == _shape(api[name]), name


class _RenamedParameter(TrajectoryServer):
    def abort(self, ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]:  # type: ignore[override]
        return super().abort(ids)


class _LostDefault(TrajectoryServer):
    def read_batch(  # type: ignore[override]
        self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]] | None
    ) -> TrainingBatch:
        return super().read_batch(group_ids, select)


class _WiderReturn(TrajectoryServer):
    def refill(self) -> list[int]:  # type: ignore[override]
        return list(super().refill())


@pytest.mark.parametrize(
    ("impl", "why"),
    [
        (_RenamedParameter, "_RenamedParameter.abort[[]('ids'"),
        (_LostDefault, "_LostDefault.read_batch[[]"),
        (_WiderReturn, "_WiderReturn.refill returns list[[]int[]]"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_the_check_rejects_a_broken_implementation(impl: type, why: str) -> None:
    found = _mismatches(impl)
    assert len(found) == 1 and fnmatch.fnmatchcase(found[0], why + "*"), found


# -- the behavioural check: one scenario, the core and the client over the service ------


def _plain(value: Any) -> Any:
    """A comparable form of what the API returns (records hold arrays)."""
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.tolist())
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return (type(value).__name__, fields)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return (type(value).__name__, [_plain(v) for v in value])
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Recorder:
    """``api``, every call's name and comparable result recorded."""

    def __init__(self, api: TrajectoryServerApi) -> None:
        self._api = api
        self.log: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = getattr(self._api, name)(*args, **kwargs)
            self.log.append((name, _plain(result)))
            return result

        return call


def _partial(traj_id: int, n: int, version: int) -> PartialTrajectory:
    return PartialTrajectory(traj_id, *_response(n, version))


def _scenario(api: Any) -> None:
    """Every call of the API once at least, as a run makes them; groups of 2."""
    api.routing_view(), api.stats(), api.group_members(0), api.group_status(0)
    api.route([0, 1, 2, 3], {0: 1, 1: 1, 2: 0, 3: 0}, "A")
    api.route([4], 0, "B")
    api.route([4, 5], 0, "B", skip_unavailable=True)  # 4 is taken: only 5
    api.routed_to("A"), api.fork(0, "A"), api.fork(0, "B"), api.state_of(0)
    api.report_progress([_partial(0, 3, 1)], "A")
    api.group_responses({0: {}}, "B", watch=[0, 9])
    api.interrupt_return([_partial(2, 2, 0)], instance_id="A")
    api.complete(0, *_response(5, 1), 1.0, "stop", {"turns": 1})
    api.complete_many([Completion(1, *_response(4, 1), 0.0, "length")], instance_id="A")
    api.hand_to_reward([FinishedTrajectory(3, *_response(2, 0), "stop")], "w1", instance_id="A")
    api.tool_waits(), api.reassign_rewards("w1", "w2")
    tokens, logprobs, versions = _response(4, 0)
    mask = np.array([True, True, False, False])
    api.next_turn([NextTurn(3, tokens, logprobs, versions, mask, b"env")], worker_id="w2")
    api.env_states([3, 99])
    api.read_batch([0], {0: [1]}), api.take_batch([0], None, read=[])
    api.requeue([5]), api.instance_lost("B"), api.ledger()
    api.route([4, 5], 0, "C")
    for tid in (4, 5):
        api.complete(tid, *_response(2, 0), 0.5, "stop")
    api.filter_group(2), api.abort([2]), api.abort_group(1)
    api.refill(), api.stats(), api.routing_view(), api.export_state()


def test_the_client_over_the_service_answers_as_the_core_does() -> None:
    config = TrajectoryServerConfig(eta=1, batch_size=2, group_size=2)
    core = _Recorder(TrajectoryServer(config, CycleSource()))
    client = _Recorder(in_process_client(TrajectoryServerService(config, CycleSource())))
    _scenario(core)
    _scenario(client)
    assert {name for name, _ in core.log} == set(_api(TrajectoryServerApi))
    assert len(client.log) == len(core.log)
    for (name, want), (_, got) in zip(core.log, client.log, strict=True):
        assert got == want, name
