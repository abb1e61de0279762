"""The trajectory server (paper §5.1): every trajectory in flight, served in MLQ order.

``TrajectoryServer`` is the in-process core; ``trajectory_server.actor`` serves it over
Ray (imported lazily) and ``trajectory_server.wire`` packs its array-heavy messages. Both
follow ``TrajectoryServerApi`` (``trajectory_server.api``), the whole API as one protocol.
"""

from trajectory_server.api import TrajectoryServerApi
from trajectory_server.errors import (
    CorruptState,
    GroupGone,
    InvalidConfig,
    InvalidPayload,
    InvalidTransition,
    NotHolder,
    TrajectoryGone,
    TrajectoryServerError,
    UnknownGroup,
    UnknownTrajectory,
    VersionConflict,
    WireError,
)
from trajectory_server.interface import PromptSource, ResumableSource, SampleLike
from trajectory_server.server import TrajectoryServer
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    LiveTrajectory,
    NextTurn,
    PartialTrajectory,
    RewardTask,
    RoutableTrajectory,
    RoutedTrajectory,
    SiblingResponses,
    SiblingTokens,
    TrainingBatch,
    TrainingGroup,
    TrainingTrajectory,
    TrajectoryServerConfig,
    TrajState,
    TSStats,
    WorkerId,
)

__all__ = [
    "AbortedTrajectory",
    "Completion",
    "CorruptState",
    "FinishedTrajectory",
    "GroupGone",
    "GroupStatus",
    "InvalidConfig",
    "InvalidPayload",
    "InvalidTransition",
    "LiveTrajectory",
    "NextTurn",
    "NotHolder",
    "PartialTrajectory",
    "PromptSource",
    "ResumableSource",
    "RewardTask",
    "RoutableTrajectory",
    "RoutedTrajectory",
    "SampleLike",
    "SiblingResponses",
    "SiblingTokens",
    "TSStats",
    "TrainingBatch",
    "TrainingGroup",
    "TrainingTrajectory",
    "TrajState",
    "TrajectoryGone",
    "TrajectoryServer",
    "TrajectoryServerApi",
    "TrajectoryServerConfig",
    "TrajectoryServerError",
    "UnknownGroup",
    "UnknownTrajectory",
    "VersionConflict",
    "WireError",
    "WorkerId",
]
