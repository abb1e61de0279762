"""The messages of the control plane's inbox, one record per kind.

Every thread but the loop's only posts these (``ControlPlane._post``); the loop applies
them in arrival order at the start of each iteration (``ControlPlane._drain_inbox``). An
*ask* carries the future its poster waits on: the loop completes it, or fails it with
the plane's error when the loop dies (:data:`ASKS` names them).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from staleflow.rewards.estimators import EvalScores
from staleflow.runtime.interface import InstanceHandle, Rewarded, StepReport
from staleness import ConsumedBatch
from staleness.types import TrajId
from trajectory_server.types import AbortedTrajectory, InstanceId

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RewardsIn:
    """Trajectories the TS now holds as completed: Occupied."""

    records: tuple[Rewarded, ...]


@dataclass(frozen=True, slots=True)
class TrajectoriesDropped:
    """The TS forgot these: aborted on the instances still holding them."""

    trajectories: tuple[AbortedTrajectory, ...]


@dataclass(frozen=True, slots=True)
class StepTrained:
    """The trainer finished a step: its record is made from ``report``."""

    report: StepReport


@dataclass(frozen=True, slots=True)
class InstanceLost:
    """``inst`` left (it died or failed); ``reserved``: what a command round had
    reserved for it when it was found gone."""

    inst: int
    reason: str
    reserved: Sequence[TrajId] = ()


@dataclass(frozen=True, slots=True)
class StopAsked:
    """Stop routing, interrupt every instance, take the final cut."""


@dataclass(frozen=True, slots=True)
class EvalScored:
    """The held-out evaluation of ``step`` (None: given up)."""

    step: int
    scores: EvalScores | None


@dataclass(frozen=True, slots=True)
class CutReleased:
    """The cut of ``steps`` is written."""

    steps: int


@dataclass(frozen=True, slots=True)
class ConsumeAsked:
    """The trainer asks for buffer ``version``; answered once it is Ready."""

    version: int
    future: Future[ConsumedBatch] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class JoinAsked:
    """A new or restarted instance joins the fleet at ``version``."""

    inst: int
    handle: InstanceHandle
    holder: InstanceId
    version: int
    kind: str  # its recovery event: instance_added | instance_restarted
    future: Future[None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class RemoveAsked:
    """Take ``inst`` out of the fleet (elastic rollout); answers its id."""

    inst: int
    future: Future[int] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ReplayAsked:
    """Apply the completions in the TS whose report a lost reward worker lost."""

    future: Future[int] = field(default_factory=Future)


Message = (
    RewardsIn
    | TrajectoriesDropped
    | StepTrained
    | InstanceLost
    | StopAsked
    | EvalScored
    | CutReleased
    | ConsumeAsked
    | JoinAsked
    | RemoveAsked
    | ReplayAsked
)
ASKS = (ConsumeAsked, JoinAsked, RemoveAsked, ReplayAsked)


class Ask(Protocol[T]):
    """A message whose poster waits on ``future``."""

    @property
    def future(self) -> Future[T]: ...
