"""Writes to the trajectory server that tolerate late messages, and only those.

In an asynchronous run a message can arrive about a trajectory (or group) that the TS
already forgot: redundancy (§4.3) aborts surplus members while they are still being
rewarded or interrupted, and the trainer's ``take_batch`` drops what is left of a
consumed group. The TS raises :class:`~trajectory_server.errors.TrajectoryGone` (or
:class:`~trajectory_server.errors.GroupGone`) for these, and changes nothing: every TS
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

from trajectory_server.errors import GroupGone, TrajectoryGone
from trajectory_server.types import AbortedTrajectory, Completion, GroupStatus, PartialTrajectory

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


class CompletionSink(Protocol):
    def complete_many(self, completions: Iterable[Completion]) -> tuple[GroupStatus, ...]: ...


class PartialSink(Protocol):
    def interrupt_return(self, partials: Sequence[PartialTrajectory]) -> None: ...


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
        except TrajectoryGone:
            pass  # at least one is gone: find out which
    done: list[Item] = []
    results: list[Result] = []
    for item in items:
        try:
            results.append(call([item]))
        except TrajectoryGone as exc:
            logger.debug("late %s dropped: %s", what, exc)
            continue
        done.append(item)
    return done, results


def complete_live(ts: CompletionSink, completions: Sequence[Completion]) -> list[Completion]:
    """Store finished trajectories as completed; returns those the TS still held (the
    rest were aborted or consumed meanwhile and must not be reported as rewarded)."""
    done, _ = _each_live(completions, ts.complete_many, "completion")
    return done


def return_live(ts: PartialSink, partials: Sequence[PartialTrajectory]) -> list[int]:
    """Hand interrupted trajectories back to the TS; returns the ids it took back."""
    done, _ = _each_live(partials, ts.interrupt_return, "partial")
    return [p.traj_id for p in done]


def abort_live(ts: Aborter, traj_ids: Sequence[int]) -> list[AbortedTrajectory]:
    """Drop trajectories from the TS; those already gone are skipped."""
    _, results = _each_live(traj_ids, ts.abort, "abort")
    return [t for batch in results for t in batch]


def abort_groups_live(ts: Aborter, group_ids: Iterable[int]) -> list[AbortedTrajectory]:
    """Drop whole groups from the TS; groups already consumed or aborted are skipped."""
    out: list[AbortedTrajectory] = []
    for gid in group_ids:
        try:
            out.extend(ts.abort_group(gid))
        except GroupGone as exc:
            logger.debug("late group abort dropped: %s", exc)
    return out
