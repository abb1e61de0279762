"""The trajectory server over Ray: a service class the actor wraps, and a client.

Every call of :class:`~trajectory_server.api.TrajectoryServerApi` is here under its own
name (``complete``, one completion, is the client's, over ``complete_many``). Array-heavy
calls (route, interrupt_return, complete_many, take_batch, the routing view,
group_responses) pass packed wire messages (``wire.py``) as bytes; the small ones pass
typed frozen records by Ray's own serialisation. Ray is imported only inside
:func:`spawn_trajectory_server`, so importing this module (or ``trajectory_server``) never
imports ray.

The actor runs one call at a time (Ray's default ``max_concurrency=1``), which is what the
single-threaded core needs. Errors raised by the core reach the caller as the same typed
exceptions (Ray re-raises them as subclasses of the original class).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from trajectory_server import wire
from trajectory_server.interface import PromptSource
from trajectory_server.server import TrajectoryServer
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    InfoValue,
    InstanceId,
    LiveTrajectory,
    NextTurn,
    PartialTrajectory,
    RewardTask,
    RoutableTrajectory,
    RoutedTrajectory,
    SiblingResponses,
    TrainingBatch,
    TrajectoryServerConfig,
    TrajState,
    TSStats,
    WorkerId,
)


class TrajectoryServerService:
    """Bytes-in, bytes-out facade of :class:`TrajectoryServer`; what the Ray actor runs."""

    def __init__(
        self, config: TrajectoryServerConfig, source: PromptSource, state: Any = None
    ) -> None:
        if state is None:
            self._ts = TrajectoryServer(config, source)
        else:
            self._ts = TrajectoryServer.restore(config, source, state)
        self._packed_view: tuple[Sequence[RoutableTrajectory], bytes] | None = None

    def route(self, request: bytes) -> bytes:
        req = wire.unpack(request, wire.RouteRequest)
        v: int | Mapping[int, int] | None = req.v_traj
        if v is None and req.v_traj_by_traj:
            v = req.v_traj_by_traj
        routed = self._ts.route(
            req.traj_ids, v, req.instance_id, skip_unavailable=req.skip_unavailable
        )
        return wire.pack(wire.RouteReply(routed))

    def interrupt_return(self, message: bytes) -> None:
        msg = wire.unpack(message, wire.InterruptReturn)
        self._ts.interrupt_return(msg.partials, instance_id=msg.instance_id)

    def complete_many(self, message: bytes) -> bytes:
        batch = wire.unpack(message, wire.CompletionBatch)
        statuses = self._ts.complete_many(
            batch.completions, instance_id=batch.instance_id, worker_id=batch.worker_id
        )
        return wire.pack(wire.GroupStatusBatch(statuses))

    def report_progress(self, message: bytes) -> tuple[int, ...]:
        msg = wire.unpack(message, wire.ProgressReport)
        return self._ts.report_progress(msg.partials, msg.instance_id)

    def group_responses(self, message: bytes) -> bytes:
        req = wire.unpack(message, wire.SiblingRequest)
        return wire.pack(self._ts.group_responses(req.known, req.instance_id, req.watch))

    def hand_to_reward(self, message: bytes) -> None:
        msg = wire.unpack(message, wire.HandToReward)
        self._ts.hand_to_reward(msg.finished, msg.worker_id, instance_id=msg.instance_id)

    def next_turn(self, message: bytes) -> None:
        msg = wire.unpack(message, wire.NextTurnBatch)
        self._ts.next_turn(msg.turns, worker_id=msg.worker_id)

    def env_states(self, traj_ids: Sequence[int]) -> dict[int, bytes]:
        return self._ts.env_states(traj_ids)

    def reassign_rewards(self, from_worker: WorkerId | None, to_worker: WorkerId | None) -> bytes:
        return wire.pack(wire.RewardTaskBatch(self._ts.reassign_rewards(from_worker, to_worker)))

    def requeue(self, traj_ids: Sequence[int]) -> None:
        self._ts.requeue(traj_ids)

    def instance_lost(self, instance_id: InstanceId) -> tuple[int, ...]:
        return self._ts.instance_lost(instance_id)

    def routed_to(self, instance_id: InstanceId) -> tuple[int, ...]:
        return self._ts.routed_to(instance_id)

    def tool_waits(self) -> tuple[tuple[tuple[int, int, int | None, int, int], InstanceId], ...]:
        return tuple((tuple(r), i) for r, i in self._ts.tool_waits())

    def fork(self, traj_id: int, instance_id: InstanceId) -> bytes:
        routed = self._ts.fork(traj_id, instance_id)
        return wire.pack(wire.RouteReply(() if routed is None else (routed,)))

    def ledger(self) -> tuple[LiveTrajectory, ...]:
        return self._ts.ledger()

    def export_state(self) -> bytes:
        return wire.pack_plain(self._ts.export_state())

    def take_batch(
        self,
        group_ids: Sequence[int],
        select: Mapping[int, Sequence[int]] | None = None,
        read: Sequence[int] = (),
    ) -> bytes:
        return wire.pack(self._ts.take_batch(group_ids, select, read))

    def read_batch(
        self, group_ids: Sequence[int], select: Mapping[int, Sequence[int]] | None = None
    ) -> bytes:
        return wire.pack(self._ts.read_batch(group_ids, select))

    def routing_view(self) -> bytes:
        view = self._ts.routing_view()
        # the core returns the same object until the queue changes: reuse its encoding
        if self._packed_view is None or self._packed_view[0] is not view:
            self._packed_view = (view, wire.pack(wire.RoutingColumns.from_records(view)))
        return self._packed_view[1]

    def refill(self) -> tuple[int, ...]:
        return self._ts.refill()

    def abort(self, traj_ids: Sequence[int]) -> tuple[AbortedTrajectory, ...]:
        return self._ts.abort(traj_ids)

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        return self._ts.abort_group(group_id)

    def filter_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        return self._ts.filter_group(group_id)

    def state_of(self, traj_id: int) -> TrajState:
        return self._ts.state_of(traj_id)

    def group_members(self, group_id: int) -> tuple[int, ...]:
        return self._ts.group_members(group_id)

    def group_status(self, group_id: int) -> GroupStatus:
        return self._ts.group_status(group_id)

    def stats(self) -> TSStats:
        return self._ts.stats()


def spawn_trajectory_server(
    config: TrajectoryServerConfig,
    source: PromptSource,
    state: Any = None,
    **actor_options: Any,
) -> TrajectoryServerClient:
    """Start the TS as a Ray actor (``ray.init`` must have run) and return a client.

    ``source`` is pickled into the actor. ``state``: what ``export_state()`` saved, to
    resume from (``source`` must then be at the saved position). ``actor_options`` go to
    ``.options()``, e.g. ``name="trajectory_server"``, ``num_cpus=1``.
    """
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "the trajectory server actor needs ray, part of StaleFlow's default install: "
            "`pip install -c constraints.txt -e .` in the checkout; or use TrajectoryServer "
            "in process"
        ) from exc
    remote_cls = ray.remote(TrajectoryServerService)
    options = {"num_cpus": 0, **actor_options}
    handle = remote_cls.options(**options).remote(config, source, state)
    return TrajectoryServerClient(handle)


class TrajectoryServerClient:
    """Blocking client of :class:`~trajectory_server.api.TrajectoryServerApi`; each call is one
    actor round trip."""

    def __init__(self, handle: Any) -> None:
        import ray  # the handle only exists if ray does

        self._ray = ray
        self.handle = handle

    def _call(self, method: str, *args: object) -> Any:
        return self._ray.get(getattr(self.handle, method).remote(*args))

    def route(
        self,
        traj_ids: Iterable[int],
        v_traj: int | Mapping[int, int] | None,
        instance_id: InstanceId,
        *,
        skip_unavailable: bool = False,
    ) -> tuple[RoutedTrajectory, ...]:
        ids = tuple(traj_ids)
        if isinstance(v_traj, Mapping):
            req = wire.RouteRequest(ids, None, dict(v_traj), instance_id, skip_unavailable)
        else:
            req = wire.RouteRequest(ids, v_traj, {}, instance_id, skip_unavailable)
        reply = self._call("route", wire.pack(req))
        return wire.unpack(reply, wire.RouteReply).trajectories

    def interrupt_return(
        self, partials: Iterable[PartialTrajectory], *, instance_id: InstanceId | None = None
    ) -> None:
        msg = wire.InterruptReturn(tuple(partials), instance_id)
        self._call("interrupt_return", wire.pack(msg))

    def complete(
        self,
        traj_id: int,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        reward: float,
        finish_reason: str,
        info: Mapping[str, InfoValue] | None = None,
        mask: np.ndarray | None = None,
    ) -> GroupStatus:
        c = Completion(traj_id, tokens, logprobs, versions, reward, finish_reason, info or {}, mask)
        return self.complete_many((c,))[0]

    def complete_many(
        self,
        completions: Iterable[Completion],
        *,
        instance_id: InstanceId | None = None,
        worker_id: WorkerId | None = None,
    ) -> tuple[GroupStatus, ...]:
        msg = wire.CompletionBatch(tuple(completions), instance_id, worker_id)
        reply = self._call("complete_many", wire.pack(msg))
        return wire.unpack(reply, wire.GroupStatusBatch).statuses

    def report_progress(
        self, partials: Iterable[PartialTrajectory], instance_id: InstanceId
    ) -> tuple[int, ...]:
        msg = wire.ProgressReport(tuple(partials), instance_id)
        return self._call("report_progress", wire.pack(msg))

    def group_responses(
        self,
        known: Mapping[int, Mapping[int, int]],
        instance_id: InstanceId | None = None,
        watch: Iterable[int] = (),
    ) -> SiblingResponses:
        """See ``TrajectoryServer.group_responses``; only new tokens travel, packed."""
        plain = {g: dict(h) if isinstance(h, Mapping) else h for g, h in known.items()}
        req = wire.SiblingRequest(plain, instance_id, tuple(watch))  # checked by the server
        return wire.unpack(self._call("group_responses", wire.pack(req)), SiblingResponses)

    def hand_to_reward(
        self,
        finished: Iterable[FinishedTrajectory],
        worker_id: WorkerId,
        *,
        instance_id: InstanceId | None = None,
    ) -> None:
        msg = wire.HandToReward(tuple(finished), worker_id, instance_id)
        self._call("hand_to_reward", wire.pack(msg))

    def next_turn(self, turns: Iterable[NextTurn], *, worker_id: WorkerId) -> None:
        self._call("next_turn", wire.pack(wire.NextTurnBatch(tuple(turns), worker_id)))

    def env_states(self, traj_ids: Iterable[int]) -> dict[int, bytes]:
        return self._call("env_states", tuple(traj_ids))

    def reassign_rewards(
        self, from_worker: WorkerId | None, to_worker: WorkerId | None
    ) -> tuple[RewardTask, ...]:
        reply = self._call("reassign_rewards", from_worker, to_worker)
        return wire.unpack(reply, wire.RewardTaskBatch).tasks

    def requeue(self, traj_ids: Iterable[int]) -> None:
        self._call("requeue", tuple(traj_ids))

    def instance_lost(self, instance_id: InstanceId) -> tuple[int, ...]:
        return self._call("instance_lost", instance_id)

    def routed_to(self, instance_id: InstanceId) -> tuple[int, ...]:
        return self._call("routed_to", instance_id)

    def tool_waits(self) -> tuple[tuple[RoutableTrajectory, InstanceId], ...]:
        """See ``TrajectoryServer.tool_waits``."""
        return tuple((RoutableTrajectory(*r), i) for r, i in self._call("tool_waits"))

    def fork(self, traj_id: int, instance_id: InstanceId) -> RoutedTrajectory | None:
        reply = wire.unpack(self._call("fork", traj_id, instance_id), wire.RouteReply)
        return reply.trajectories[0] if reply.trajectories else None

    def ledger(self) -> tuple[LiveTrajectory, ...]:
        return self._call("ledger")

    def export_state(self) -> dict[str, Any]:
        """The server's state (arrays travel packed as raw bytes, not pickled)."""
        return wire.unpack_plain(self._call("export_state"))

    def take_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
        read: Iterable[int] = (),
    ) -> TrainingBatch:
        plain = None if select is None else {g: tuple(ids) for g, ids in select.items()}
        reply = self._call("take_batch", tuple(group_ids), plain, tuple(read))
        return wire.unpack(reply, TrainingBatch)

    def read_batch(
        self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]] | None = None
    ) -> TrainingBatch:
        plain = None if select is None else {g: tuple(ids) for g, ids in select.items()}
        return wire.unpack(self._call("read_batch", tuple(group_ids), plain), TrainingBatch)

    def routing_view(self) -> tuple[RoutableTrajectory, ...]:
        return wire.unpack(self._call("routing_view"), wire.RoutingColumns).to_records()

    def refill(self) -> tuple[int, ...]:
        return self._call("refill")

    def abort(self, traj_ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]:
        return self._call("abort", tuple(traj_ids))

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        return self._call("abort_group", group_id)

    def filter_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        return self._call("filter_group", group_id)

    def state_of(self, traj_id: int) -> TrajState:
        return self._call("state_of", traj_id)

    def group_members(self, group_id: int) -> tuple[int, ...]:
        return self._call("group_members", group_id)

    def group_status(self, group_id: int) -> GroupStatus:
        return self._call("group_status", group_id)

    def stats(self) -> TSStats:
        return self._call("stats")
