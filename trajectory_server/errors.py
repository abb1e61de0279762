"""Typed errors of the trajectory server. A call that raises one changed nothing."""

from __future__ import annotations


class TrajectoryServerError(Exception):
    """Base class: misuse of the trajectory server."""


class InvalidConfig(TrajectoryServerError, ValueError):
    """A configuration value is out of range."""


class UnknownTrajectory(TrajectoryServerError, KeyError):
    """The trajectory id was never created by this server."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown trajectory"


class TrajectoryGone(UnknownTrajectory):
    """The trajectory existed but was consumed by the trainer or aborted.

    Late messages about such trajectories are expected in an asynchronous system (a reward
    that arrives after its group was aborted); callers may catch this and drop the message.
    """


class UnknownGroup(TrajectoryServerError, KeyError):
    """The group id was never created, or was already consumed or aborted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown group"


class GroupGone(UnknownGroup):
    """The group existed but was consumed by the trainer or aborted: like
    :class:`TrajectoryGone`, a late message about it may be caught and dropped."""


class InvalidTransition(TrajectoryServerError):
    """The trajectory is not in the state the call requires."""


class VersionConflict(InvalidTransition):
    """A route would change, or fail to set, a trajectory's ``V_traj``."""


class NotHolder(InvalidTransition):
    """A message about a trajectory from an instance that no longer holds it (it was
    declared lost and the trajectory went back to the queue, or was routed elsewhere).

    Expected after a recovery; callers may catch this and drop the late message.
    """


class InvalidPayload(TrajectoryServerError, ValueError):
    """Token, logprob or version arrays (or the reward) are malformed."""


class CorruptState(TrajectoryServerError, ValueError):
    """A saved trajectory server state that cannot be restored."""


class WireError(TrajectoryServerError, ValueError):
    """A wire message could not be decoded."""
