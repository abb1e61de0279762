"""Recovery: run checkpoints and what a run needs to resume or to survive a lost actor.

Pure of engines and Ray: the checkpoint format (``checkpoint``), its errors (``errors``)
and the restore that rebuilds the staleness manager and the trajectory server and makes
them agree (``restore``). The launcher decides when to call them.
"""

from staleflow.recovery.checkpoint import (
    Checkpoint,
    RunState,
    find_checkpoint,
    list_checkpoints,
    read_checkpoint,
    read_manifest,
    write_checkpoint,
)
from staleflow.recovery.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    NotACheckpoint,
    ProtocolMismatch,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CorruptCheckpoint",
    "IncompatibleCheckpoint",
    "NotACheckpoint",
    "ProtocolMismatch",
    "RunState",
    "find_checkpoint",
    "list_checkpoints",
    "read_checkpoint",
    "read_manifest",
    "write_checkpoint",
]
