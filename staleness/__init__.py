"""The global consistency protocol (paper §4): virtual staleness buffers.

Pure Python: no ray, torch or web imports, so that the coordinator, the simulator and the
tests can drive it directly.
"""

from staleness.errors import (
    CorruptState,
    DuplicateTrajectory,
    InvalidConfig,
    NotOccupied,
    NotReady,
    NotReserved,
    StalenessError,
    StalenessViolation,
    UnknownGroup,
)
from staleness.manager import StalenessManager
from staleness.sketch import Sketch
from staleness.types import (
    BufferState,
    BufferView,
    ConsumedBatch,
    ConsumedGroup,
    Entry,
    EntryKind,
    GroupId,
    ManagerView,
    Outcome,
    StalenessConfig,
    TrajId,
)

__all__ = [
    "BufferState",
    "BufferView",
    "ConsumedBatch",
    "ConsumedGroup",
    "CorruptState",
    "DuplicateTrajectory",
    "Entry",
    "EntryKind",
    "GroupId",
    "InvalidConfig",
    "ManagerView",
    "NotOccupied",
    "NotReady",
    "NotReserved",
    "Outcome",
    "Sketch",
    "StalenessConfig",
    "StalenessError",
    "StalenessManager",
    "StalenessViolation",
    "TrajId",
    "UnknownGroup",
]
