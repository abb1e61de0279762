"""Plain data of the trajectory server (paper §5.1): configuration, records and payloads.

Arrays follow one convention everywhere: tokens are 1-D ``np.int32``, logprobs 1-D
``np.float32``, per-token policy versions 1-D ``np.int32``, and the loss mask 1-D
``np.bool_``, all four of the same length. A *response* is everything after the prompt
so far; a partial trajectory's response grows each time it is routed, interrupted and
routed again.

The trajectory model (multi-turn): a response is a sequence of segments, model turns
(tokens the policy generated: mask True, their logprobs and the version of the policy
that generated each) and environment observations (tokens the model did not generate:
mask False, never trained). An observation token carries logprob ``0.0`` and the version
of the model token before it, so every version stays ``>= V_traj`` and ``V_traj`` stays
the version of the first generated token. A single-turn response is one model turn: its
mask is all True, which is the default wherever a mask is not given.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from staleness.bounds import config_problem
from trajectory_server.errors import InvalidConfig

TrajId = int
GroupId = int
InstanceId = int | str
WorkerId = int | str  # a reward worker
InfoValue = int | float | str


def all_trained(n: int) -> np.ndarray:
    """The loss mask of a response of ``n`` tokens that the model generated entirely."""
    mask = np.ones(n, dtype=np.bool_)
    mask.flags.writeable = False
    return mask


def extend_mask(mask: np.ndarray, n: int) -> np.ndarray:
    """``mask`` (the loss mask of a response's first tokens) continued with True up to
    ``n`` tokens: what a rollout engine adds to a response is the model's own."""
    if len(mask) > n:
        raise ValueError(
            f"a loss mask of {len(mask)} tokens for a response of {n}: the response must "
            "start with the tokens the mask covers"
        )
    if len(mask) == n:
        return mask
    out = np.ones(n, dtype=np.bool_)
    out[: len(mask)] = mask
    out.flags.writeable = False
    return out


def _default_mask(record: Any) -> None:
    """``__post_init__`` of the payloads: a mask left out (None) means every token is the
    model's own (single-turn), so older senders and single-turn code need not name it."""
    if record.mask is None:
        object.__setattr__(record, "mask", all_trained(len(record.tokens)))


class TrajState(enum.StrEnum):
    """Where a live trajectory is. Consumed and aborted trajectories are gone."""

    QUEUED = "queued"  # in the TS and routable: initial, or an interrupted partial
    ROUTED = "routed"  # handed to a rollout instance (generating, or being rewarded)
    REWARDING = "rewarding"  # finished; its whole response is in the TS; a worker scores it
    COMPLETED = "completed"  # finished and rewarded; waits for its group to be consumed


@dataclass(slots=True)
class TrajectoryServerConfig:
    """Configuration of the trajectory server.

    eta: the staleness bound; with ``batch_size`` it sizes the default capacity.
    batch_size: groups per training step.
    group_size: trajectories per group that training needs (G).
    group_redundancy: r_g; each group runs ``floor(G * (1 + r_g))`` trajectories (§4.3).
    batch_redundancy: r_b; widens the default capacity to
        ``(eta + 1) * floor(batch_size * (1 + r_b))`` groups, one per staleness-buffer entry.
    capacity_groups: overrides the default capacity (groups held at once, in any state).
    auto_refill: sample new prompts as soon as groups leave (consumed or aborted).
    temperature: the rollout sampling temperature, handed to the trainer with every
        :class:`TrainingBatch` (the logprobs the engines record are of ``softmax(logits / T)``).
    """

    eta: int = 1
    batch_size: int = 1
    group_size: int = 1
    group_redundancy: float = 0.0
    batch_redundancy: float = 0.0
    capacity_groups: int | None = None
    auto_refill: bool = True
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InvalidConfig(
                f"temperature={self.temperature}; use the rollout's sampling temperature (> 0)"
            )
        # the staleness manager's bounds (staleness.bounds): what one accepts, both do
        problem = config_problem(
            self.eta,
            self.batch_size,
            self.group_size,
            self.batch_redundancy,
            self.group_redundancy,
        )
        if problem is not None:
            raise InvalidConfig(problem)
        if self.capacity_groups is not None and self.capacity_groups < 1:
            raise InvalidConfig(
                f"capacity_groups={self.capacity_groups}; it must be at least 1, "
                "or None for (eta + 1) * batch_size"
            )

    @property
    def trajectories_per_group(self) -> int:
        return int(self.group_size * (1.0 + self.group_redundancy) + 1e-9)

    @property
    def capacity(self) -> int:
        """Groups the TS holds at once."""
        if self.capacity_groups is not None:
            return self.capacity_groups
        entries = int(self.batch_size * (1.0 + self.batch_redundancy) + 1e-9)
        return (self.eta + 1) * entries


class RoutableTrajectory(NamedTuple):
    """One entry of the routing view (the MLQ of §5.3), as the coordinator reads it.

    An immutable named tuple rather than a frozen dataclass: the view holds thousands of
    these, rebuilt every coordinator cycle on the Ray client side, and a named tuple is
    built about three times faster.
    """

    traj_id: int
    group_id: int
    v_traj: int | None  # None: initial trajectory, not yet routed
    length: int  # prompt tokens + tokens generated so far
    prompt_len: int


class LiveTrajectory(NamedTuple):
    """Where one live trajectory is (``TrajectoryServer.ledger``), for audits and restores."""

    traj_id: int
    group_id: int
    state: TrajState
    v_traj: int | None
    holder: int | str | None  # its instance (ROUTED) or reward worker (REWARDING)
    tokens: int  # response tokens the TS holds
    # a COMPLETED one's reward; None otherwise, and when its reward function failed
    # (dynamic sampling decides on the graded rewards of a group, as the advantages do)
    reward: float | None = None


@dataclass(frozen=True, slots=True, eq=False)
class RoutedTrajectory:
    """What a rollout instance receives for one routed trajectory.

    The instance continues generation after ``prompt + tokens``; ``tokens``, ``logprobs``
    and ``versions`` are empty for an initial trajectory. Every response it sends back
    (``PartialTrajectory`` or ``Completion``) must start with these tokens.
    """

    traj_id: int
    group_id: int
    v_traj: int
    sample_id: int
    answer: str  # ground truth, carried along for the reward worker
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    mask: np.ndarray | None = None  # bool, one per token; None: all True

    def __post_init__(self) -> None:
        _default_mask(self)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


@dataclass(frozen=True, slots=True, eq=False)
class PartialTrajectory:
    """An interrupted trajectory returned to the TS: the whole response so far."""

    traj_id: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    mask: np.ndarray | None = None  # bool, one per token; None: all True

    def __post_init__(self) -> None:
        _default_mask(self)


@dataclass(frozen=True, slots=True, eq=False)
class Completion:
    """A finished, rewarded trajectory sent to the TS: the whole response."""

    traj_id: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    finish_reason: str  # e.g. "stop" or "length", as the engine reported it
    info: Mapping[str, InfoValue] = field(default_factory=dict)
    mask: np.ndarray | None = None  # bool, one per token; None: all True

    def __post_init__(self) -> None:
        _default_mask(self)


@dataclass(frozen=True, slots=True, eq=False)
class FinishedTrajectory:
    """A trajectory that finished generating, handed to a reward worker: its whole
    response, stored in the TS so that another worker can score it if this one is lost."""

    traj_id: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    mask: np.ndarray | None = None  # bool, one per token; None: all True

    def __post_init__(self) -> None:
        _default_mask(self)


@dataclass(frozen=True, slots=True, eq=False)
class RewardTask:
    """Everything a reward worker needs to score one REWARDING trajectory again."""

    traj_id: int
    group_id: int
    v_traj: int
    sample_id: int
    answer: str
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    mask: np.ndarray | None = None  # bool, one per token; None: all True
    env_state: bytes = b""  # the environment's packed state; b"": none (single-turn)

    def __post_init__(self) -> None:
        _default_mask(self)


@dataclass(frozen=True, slots=True, eq=False)
class NextTurn:
    """A multi-turn trajectory whose environment answered its last model turn and whose
    episode goes on: the whole response with the observation appended (mask False, logprob
    0, the version of the model token before it) and the environment's state after the
    step, packed (plain data, opaque to the TS). It returns to the queue for its next
    turn with its ``V_traj``, as an interrupted partial does."""

    traj_id: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    mask: np.ndarray | None
    env_state: bytes


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """Progress of a group after a completion."""

    group_id: int
    completed: int  # completed trajectories waiting in the TS
    live: int  # trajectories of the group still in the TS, in any state

    @property
    def all_completed(self) -> bool:
        return self.completed == self.live


@dataclass(frozen=True, slots=True)
class AbortedTrajectory:
    """A trajectory the TS dropped; if it was ROUTED, its instance must abort it too."""

    traj_id: int
    group_id: int
    state: TrajState  # its state when it was dropped
    instance_id: InstanceId | None  # set when it was ROUTED


@dataclass(frozen=True, slots=True, eq=False)
class TrainingTrajectory:
    """A completed trajectory as the trainer receives it."""

    traj_id: int
    v_traj: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    finish_reason: str
    info: Mapping[str, InfoValue] = field(default_factory=dict)
    mask: np.ndarray | None = None  # bool, one per token; None: all True

    def __post_init__(self) -> None:
        _default_mask(self)


@dataclass(frozen=True, slots=True, eq=False)
class TrainingGroup:
    group_id: int
    sample_id: int
    answer: str
    prompt: np.ndarray
    trajectories: tuple[TrainingTrajectory, ...]


@dataclass(frozen=True, slots=True, eq=False)
class TrainingBatch:
    """What ``take_batch`` hands to the trainer.

    ``dropped``: members of the taken groups that were not taken (not completed, or not
    selected); the TS forgot them, and those that were ROUTED must be aborted on their
    instances.

    ``temperature``: the sampling temperature ``T`` of the trajectories. Their logprobs are
    of ``softmax(logits / T)`` (before any top-p/top-k truncation), so the trainer scores
    its policy under the same ``T`` for the importance ratios to compare one distribution.
    """

    groups: tuple[TrainingGroup, ...]
    dropped: tuple[AbortedTrajectory, ...] = ()
    temperature: float = 1.0


@dataclass(frozen=True, slots=True, eq=False)
class SiblingTokens:
    """Tokens of one trajectory's response from index ``start`` on (``group_responses``)."""

    group_id: int
    traj_id: int
    start: int
    tokens: np.ndarray  # int32


@dataclass(frozen=True, slots=True, eq=False)
class SiblingResponses:
    """What ``group_responses`` hands an instance: the responses of the asked groups'
    members beyond the lengths it has of them, and the asked groups that are gone
    (consumed, aborted or filtered)."""

    responses: tuple[SiblingTokens, ...]
    gone: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TSStats:
    """Counts for the dashboard. ``*_by_v`` map ``V_traj`` to a count; initial
    trajectories (no ``V_traj`` yet) are counted in ``initial`` only."""

    capacity_groups: int
    groups: int
    queued: int
    routed: int
    completed: int
    initial: int
    queued_by_v: dict[int, int]
    routed_by_v: dict[int, int]
    completed_by_v: dict[int, int]
    created_trajectories: int
    consumed_trajectories: int
    aborted_trajectories: int
    created_groups: int
    consumed_groups: int
    aborted_groups: int
    dataset_exhausted: bool
    rewarding: int = 0  # finished, with (or waiting for) a reward worker
    # completed groups dynamic sampling dropped (all rewards equal), and their trajectories
    filtered_trajectories: int = 0
    filtered_groups: int = 0

    def metrics(self) -> dict[str, float]:
        """Flat metric keys, e.g. ``ts/queued``."""
        out: dict[str, float] = {
            f"ts/{name}": float(getattr(self, name))
            for name in (
                "capacity_groups",
                "groups",
                "queued",
                "routed",
                "completed",
                "rewarding",
                "initial",
                "created_trajectories",
                "consumed_trajectories",
                "aborted_trajectories",
                "created_groups",
                "consumed_groups",
                "aborted_groups",
                "filtered_trajectories",
                "filtered_groups",
            )
        }
        for state, counts in (
            ("queued", self.queued_by_v),
            ("routed", self.routed_by_v),
            ("completed", self.completed_by_v),
        ):
            for v, n in counts.items():
                out[f"ts/{state}_by_v/{v}"] = float(n)
        return out
