"""Contracts between the runtime's components (no logic).

Each component is a plain class with a blocking API; in a deployment it runs inside a
Ray actor and its peers hold *clients* with the same methods (``staleflow.runtime.workers.actors``),
in unit tests they hold the objects themselves. Payloads are typed frozen records whose
arrays travel as numpy buffers, never as lists of Python ints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.types import InstanceSnapshot
from staleflow.rollout.instance import InstanceTimes
from staleness.types import ConsumedBatch, ConsumedGroup
from trajectory_server.types import AbortedTrajectory


class InstanceGone(RuntimeError):
    """A rollout instance cannot serve any more: its process died, its engine failed, or
    it was declared lost. The control plane gives back what it held and the supervisor
    restarts it (``docs/recovery.md``); ``inst`` names it."""

    def __init__(self, inst: int, reason: str) -> None:
        self.inst, self.reason = inst, reason
        super().__init__(f"rollout instance {inst} is gone: {reason}")

    def __reduce__(self) -> tuple[object, ...]:  # crosses Ray as itself
        return (type(self), (self.inst, self.reason))


class StopRequested(RuntimeError):
    """The run is stopping (Ctrl-C, SIGTERM, or the last step): a Consume asked for now is
    refused so that the trainer ends its loop and the run can checkpoint."""


class InstanceHandle(Protocol):
    """A rollout instance as the control plane drives it.

    Route and Interrupt move payloads between the instance and the trajectory server
    directly; the control plane only names trajectories and versions.
    """

    def snapshot(self) -> InstanceSnapshot: ...

    def route(self, traj_ids: Sequence[int], v_traj: Mapping[int, int]) -> tuple[int, ...]:
        """Fetch these QUEUED trajectories from the TS (initial ones get ``v_traj``) and
        start them; returns those the TS still had."""
        ...

    def interrupt(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        """Stop these and hand their partial responses back to the TS; returns those that
        were still here."""
        ...

    def abort(self, traj_ids: Sequence[int]) -> tuple[int, ...]: ...

    def pull(self, at_least: int) -> int:
        """Load the PS's latest weights (version >= ``at_least``); returns the version."""
        ...

    def times(self) -> InstanceTimes: ...

    def drop_prefixes(self, traj_ids: Sequence[int]) -> object:
        """Free the KV kept for the next turns of ``traj_ids`` (their episodes ended):
        a hint, so a client need not wait for it (an engine that keeps none ignores it)."""
        ...


@dataclass(frozen=True, slots=True)
class Rewarded:
    """A trajectory that the TS now holds as completed; the control plane Occupies it."""

    traj_id: int
    group_id: int
    v_traj: int
    reward: float
    error: str  # "" unless the reward function failed (then reward is 0.0)
    response_len: int
    finish_reason: str
    instance: int
    # a multi-turn episode's (staleflow.envs): its model turns (0: a single-turn response),
    # tool calls and errors, and the seconds its tools took
    turns: int = 0
    tool_calls: int = 0
    env_errors: int = 0
    tool_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepReport:
    """One training step, as the trainer reports it to the control plane.

    ``version``: the buffer consumed (the policy moved from ``version`` to ``version+1``).
    ``staleness``: ``version - V_traj`` -> number of trajectories trained on.
    """

    version: int
    wait_s: float  # waiting for the buffer to be Ready
    train_s: float
    push_wait_s: float  # waiting for the previous Push (0 when it overlapped fully)
    trajectories: int
    tokens: int
    staleness: Mapping[int, int]
    metrics: Mapping[str, float] = field(default_factory=dict)
    consumed_traj_ids: tuple[int, ...] = ()
    token_staleness: Mapping[int, int] = field(default_factory=dict)  # per generated token
    # trainer.stream: groups trained on before the buffer was Ready (None: not streaming)
    streamed_groups: int | None = None


@dataclass(frozen=True, slots=True)
class TrainerGroups:
    """The occupied groups of the trainer's buffer so far, and whether it is Ready."""

    groups: tuple[ConsumedGroup, ...]
    ready: bool


class ControlHandle(Protocol):
    """The control plane as the trainer and the reward workers reach it."""

    def rewarded(self, records: Sequence[Rewarded]) -> None: ...

    def consume(self, version: int, timeout_s: float | None = None) -> ConsumedBatch:
        """Block until buffer ``version`` is Ready, Consume it and return it."""
        ...

    def dropped(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        """The TS forgot these; abort those still on instances."""
        ...

    def trainer_groups(self, version: int, have: int, wait_s: float) -> TrainerGroups:
        """Buffer ``version``'s occupied groups so far (``trainer.stream``); returns once
        there are more than ``have``, the buffer is Ready, or ``wait_s`` passed. Raises
        ``StopRequested`` once the run stops."""
        ...

    def trained(self, report: StepReport) -> None: ...
