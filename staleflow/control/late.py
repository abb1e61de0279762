"""Writes to the trajectory server that tolerate late messages, and only those.

In an asynchronous run a message can arrive about a trajectory (or group) that the TS
already forgot: redundancy (§4.3) aborts surplus members while they are still being
rewarded or interrupted, and the trainer's ``take_batch`` drops what is left of a
consumed group. The TS raises :class:`~trajectory_server.errors.TrajectoryGone` (or
:class:`~trajectory_server.errors.GroupGone`) for these. After a recovery, a message can
also come from an instance that was declared lost, or a reward worker whose work was
reassigned (``staleflow.recovery``): the TS raises
:class:`~trajectory_server.errors.NotHolder` when the message names its sender. Either
way the TS changes nothing: every TS
call validates its whole input first. Each function below tries the whole batch in one
call (one round trip in the usual case) and, only when something in it was gone, again
one item at a time, dropping the gone ones. Every other error, a genuinely wrong message,
propagates. The functions take any object with the TS's methods (the core, its Ray
client, or a lock wrapper).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from trajectory_server.errors import GroupGone, NotHolder, TrajectoryGone
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    InstanceId,
    NextTurn,
    PartialTrajectory,
    WorkerId,
)

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")
LATE = (TrajectoryGone, NotHolder)  # what a late message gets from the TS


class CompletionSink(Protocol):
    def complete_many(
        self,
        completions: Iterable[Completion],
        *,
        instance_id: InstanceId | None = None,
        worker_id: WorkerId | None = None,
    ) -> tuple[GroupStatus, ...]: ...


class PartialSink(Protocol):
    def interrupt_return(
        self, partials: Sequence[PartialTrajectory], *, instance_id: InstanceId | None = None
    ) -> None: ...


class RewardHandOff(Protocol):
    def hand_to_reward(
        self,
        finished: Iterable[FinishedTrajectory],
        worker_id: WorkerId,
        *,
        instance_id: InstanceId | None = None,
    ) -> None: ...


class TurnSink(Protocol):
    def next_turn(self, turns: Iterable[NextTurn], *, worker_id: WorkerId) -> None: ...


class Aborter(Protocol):
    def abort(self, traj_ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]: ...

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]: ...


def _each_live(
    items: Sequence[Item],
    call: Callable[[Sequence[Item]], Result],
    what: str,
) -> tuple[list[Item], list[Result]]:
    """``call(items)``; if one was gone, ``call([item])`` for each. Returns the items that
    went through and the results of the calls that did."""
    if not items:
        return [], []
    if len(items) > 1:
        try:
            return list(items), [call(items)]
        except LATE:
            pass  # at least one is gone or not the sender's any more: find out which
    done: list[Item] = []
    results: list[Result] = []
    for item in items:
        try:
            results.append(call([item]))
        except LATE as exc:
            logger.debug("late %s dropped: %s", what, exc)
            continue
        done.append(item)
    return done, results


def complete_live(
    ts: CompletionSink,
    completions: Sequence[Completion],
    *,
    worker_id: WorkerId | None = None,
    instance_id: InstanceId | None = None,
) -> list[Completion]:
    """Store finished trajectories as completed; returns those the TS still held (the
    rest were aborted or consumed meanwhile, reassigned from ``worker_id`` to another
    worker, or, with ``instance_id``, no longer ROUTED to it, and must not be reported
    as rewarded)."""
    named = {
        k: v for k, v in (("worker_id", worker_id), ("instance_id", instance_id)) if v is not None
    }

    def call(items: Sequence[Completion]) -> tuple[GroupStatus, ...]:
        return ts.complete_many(items, **named)

    done, _ = _each_live(completions, call, "completion")
    return done


def return_live(
    ts: PartialSink,
    partials: Sequence[PartialTrajectory],
    *,
    instance_id: InstanceId | None = None,
) -> list[int]:
    """Hand interrupted trajectories back to the TS; returns the ids it took back (not
    those gone meanwhile, nor, with ``instance_id``, those no longer held by it)."""

    def call(items: Sequence[PartialTrajectory]) -> None:
        if instance_id is None:
            return ts.interrupt_return(items)
        return ts.interrupt_return(items, instance_id=instance_id)

    done, _ = _each_live(partials, call, "partial")
    return [p.traj_id for p in done]


def hand_live(
    ts: RewardHandOff,
    finished: Sequence[FinishedTrajectory],
    worker_id: WorkerId,
    *,
    instance_id: InstanceId | None = None,
) -> list[int]:
    """Record finished trajectories in the TS as being scored by ``worker_id``; returns
    the ids it took (not those gone meanwhile, nor those no longer held by
    ``instance_id``: the instance was declared lost and they are queued again)."""

    def call(items: Sequence[FinishedTrajectory]) -> None:
        ts.hand_to_reward(items, worker_id, instance_id=instance_id)

    done, _ = _each_live(finished, call, "hand-off to reward")
    return [f.traj_id for f in done]


def next_turn_live(ts: TurnSink, turns: Sequence[NextTurn], worker_id: WorkerId) -> list[int]:
    """Queue multi-turn trajectories for their next turn; returns the ids the TS took (not
    those aborted meanwhile, e.g. by redundancy, nor those reassigned from ``worker_id``)."""

    def call(items: Sequence[NextTurn]) -> None:
        ts.next_turn(items, worker_id=worker_id)

    done, _ = _each_live(turns, call, "next turn")
    return [n.traj_id for n in done]


def abort_live(ts: Aborter, traj_ids: Sequence[int]) -> list[AbortedTrajectory]:
    """Drop trajectories from the TS; those already gone are skipped."""
    _, results = _each_live(traj_ids, ts.abort, "abort")
    return [t for batch in results for t in batch]


class GroupFilterSink(Protocol):
    def filter_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]: ...


def filter_group_live(ts: GroupFilterSink, group_id: int) -> list[AbortedTrajectory]:
    """Drop a group dynamic sampling filtered out; one already gone is skipped."""
    try:
        return list(ts.filter_group(group_id))
    except GroupGone as exc:
        logger.debug("late group filter dropped: %s", exc)
        return []


def abort_groups_live(ts: Aborter, group_ids: Iterable[int]) -> list[AbortedTrajectory]:
    """Drop whole groups from the TS; groups already consumed or aborted are skipped."""
    out: list[AbortedTrajectory] = []
    for gid in group_ids:
        try:
            out.extend(ts.abort_group(gid))
        except GroupGone as exc:
            logger.debug("late group abort dropped: %s", exc)
    return out
