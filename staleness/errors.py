"""Typed errors of the staleness manager. Every one leaves the manager's state unchanged."""

from __future__ import annotations


class StalenessError(Exception):
    """Base class: misuse of the staleness protocol."""


class InvalidConfig(StalenessError, ValueError):
    """A configuration value is out of range."""


class UnknownGroup(StalenessError, KeyError):
    """The group id is not tracked (never reserved, or closed so long ago it was forgotten)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown group"


class DuplicateTrajectory(StalenessError):
    """The trajectory was already reserved or completed."""


class NotReserved(StalenessError):
    """Occupy (complete) of a trajectory that has no reservation."""


class NotOccupied(StalenessError):
    """Filter of a group that is not occupied (its rewards are not all known yet)."""


class StalenessViolation(StalenessError):
    """A Reserve would break the staleness bound: no admissible buffer slot exists."""


class NotReady(StalenessError):
    """Consume of a buffer that is not Ready."""


class CorruptState(StalenessError, ValueError):
    """An exported state that cannot be restored."""
