"""Typed errors of run checkpoints. Reading a checkpoint never changes its folder, so a
refused one is exactly as it was."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: a run checkpoint cannot be written or used."""


class NotACheckpoint(CheckpointError, FileNotFoundError):
    """The path holds no run checkpoint (not a run folder, or one that never saved)."""


class CorruptCheckpoint(CheckpointError, ValueError):
    """A checkpoint whose files are missing, truncated, altered or inconsistent."""


class IncompatibleCheckpoint(CheckpointError, ValueError):
    """A sound checkpoint that this run cannot use (another format or protocol)."""


class ProtocolMismatch(IncompatibleCheckpoint):
    """The run's protocol settings differ from the checkpoint's; ``key`` names the first."""

    def __init__(self, key: str, saved: object, given: object) -> None:
        self.key, self.saved, self.given = key, saved, given
        super().__init__(
            f"the checkpoint was written with {key}={saved!r} but this run has {key}={given!r}; "
            f"the staleness buffers and groups in it only mean something with the same "
            f"settings: resume with {key}={saved!r}, or start a new run"
        )
