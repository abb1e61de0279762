"""``group_responses``: the TS serves each instance the responses of the other members of
its trajectories' groups (grouped speculative decoding's drafts), only the tokens past
the lengths the instance has, and which asked groups are gone. One contract, checked on
the core, on the bytes service (its message packed and unpacked by hand) and on the
client over that service (an in-process handle: no Ray)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import pytest

from tests.trajectory_server.conftest import CycleSource, in_process_client
from trajectory_server import (
    InvalidPayload,
    PartialTrajectory,
    SiblingResponses,
    TrajectoryServer,
    TrajectoryServerConfig,
    wire,
)
from trajectory_server.actor import TrajectoryServerService

Ask = Callable[..., SiblingResponses]


def _service_ask(service: TrajectoryServerService) -> Ask:
    def ask(
        known: Mapping[int, Mapping[int, int]],
        instance_id: int | str | None = None,
        watch: Iterable[int] = (),
    ) -> SiblingResponses:
        plain = {g: dict(h) if isinstance(h, Mapping) else h for g, h in known.items()}
        req = wire.SiblingRequest(plain, instance_id, tuple(watch))
        return wire.unpack(service.group_responses(wire.pack(req)), SiblingResponses)

    return ask


@pytest.fixture(params=["server", "service", "client"])
def api(request: pytest.FixtureRequest) -> tuple[TrajectoryServer, Ask]:
    """The core to drive, and ``group_responses`` through the implementation under test."""
    config = TrajectoryServerConfig(eta=1, batch_size=2, group_size=3)
    service = TrajectoryServerService(config, CycleSource())
    core = service._ts
    if request.param == "server":
        return core, core.group_responses
    if request.param == "service":
        return core, _service_ask(service)
    return core, in_process_client(service).group_responses


def _partial(traj_id: int, tokens: list[int]) -> PartialTrajectory:
    n = len(tokens)
    return PartialTrajectory(
        traj_id, np.array(tokens, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32)
    )


def _got(reply: SiblingResponses) -> list[tuple[int, int, int, list[int]]]:
    return [(r.group_id, r.traj_id, r.start, r.tokens.tolist()) for r in reply.responses]


def test_only_new_tokens_of_other_instances_members_travel(api) -> None:
    ts, ask = api
    assert ts.group_members(0) == (0, 1, 2)
    ts.route([0], 0, "A")
    ts.route([1, 2], 0, "B")
    ts.report_progress([_partial(0, [5, 6, 7, 8, 9])], "A")
    ts.report_progress([_partial(1, [40, 41, 42])], "B")
    # B has nothing yet: trajectory 0's response; not its own 1, and 2 has no tokens
    reply = ask({0: {}}, "B")
    assert _got(reply) == [(0, 0, 0, [5, 6, 7, 8, 9])] and reply.gone == ()
    assert reply.responses[0].tokens.dtype == np.int32
    ts.report_progress([_partial(0, [5, 6, 7, 8, 9, 10, 11])], "A")
    assert _got(ask({0: {0: 5}}, "B")) == [(0, 0, 5, [10, 11])]
    assert _got(ask({0: {0: 7}}, "B")) == []
    # A is given B's trajectory 1 (all of it) past what it has
    assert _got(ask({0: {1: 1}}, "A")) == [(0, 1, 1, [41, 42])]
    # a completed member is a sibling too
    n = 9
    ts.complete(0, np.arange(5, 5 + n, dtype=np.int32), np.zeros(n, np.float32),
                np.zeros(n, np.int32), 1.0, "stop")  # fmt: skip
    assert _got(ask({0: {0: 7}}, "B")) == [(0, 0, 7, [12, 13])]


def test_groups_that_left_are_reported_gone(api) -> None:
    ts, ask = api
    ts.route([3], 0, "A")  # group 1
    n = 2
    ts.complete(3, np.array([7, 8], np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32),
                1.0, "stop")  # fmt: skip
    reply = ask({0: {}}, "B", watch=[1, 99])
    assert reply.gone == (99,)  # group 99 never was
    ts.abort_group(0)
    ts.take_batch([1])
    reply = ask({0: {}, 2: {}}, "B", watch=[1])
    assert reply.gone == (0, 1) and _got(reply) == []


@pytest.mark.parametrize(
    "known",
    [{0: {1: -1}}, {0: [1]}, {"0": {}}, {0: {1: True}}],
)
def test_a_malformed_request_is_refused(api, known) -> None:
    _, ask = api
    with pytest.raises((InvalidPayload, wire.WireError)):
        ask(known, "B")
