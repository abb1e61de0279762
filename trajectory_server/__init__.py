"""The trajectory server (paper §5.1): every trajectory in flight, served in MLQ order.

``TrajectoryServer`` is the in-process core; ``trajectory_server.actor`` serves it over
Ray (imported lazily) and ``trajectory_server.wire`` packs its array-heavy messages.
"""

from trajectory_server.errors import (
    GroupGone,
    InvalidConfig,
    InvalidPayload,
    InvalidTransition,
    TrajectoryGone,
    TrajectoryServerError,
    UnknownGroup,
    UnknownTrajectory,
    VersionConflict,
    WireError,
)
from trajectory_server.interface import PromptSource, SampleLike
from trajectory_server.server import TrajectoryServer
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    GroupStatus,
    PartialTrajectory,
    RoutableTrajectory,
    RoutedTrajectory,
    TrainingBatch,
    TrainingGroup,
    TrainingTrajectory,
    TrajectoryServerConfig,
    TrajState,
    TSStats,
)

__all__ = [
    "AbortedTrajectory",
    "Completion",
    "GroupGone",
    "GroupStatus",
    "InvalidConfig",
    "InvalidPayload",
    "InvalidTransition",
    "PartialTrajectory",
    "PromptSource",
    "RoutableTrajectory",
    "RoutedTrajectory",
    "SampleLike",
    "TSStats",
    "TrainingBatch",
    "TrainingGroup",
    "TrainingTrajectory",
    "TrajState",
    "TrajectoryGone",
    "TrajectoryServer",
    "TrajectoryServerConfig",
    "TrajectoryServerError",
    "UnknownGroup",
    "UnknownTrajectory",
    "VersionConflict",
    "WireError",
]
