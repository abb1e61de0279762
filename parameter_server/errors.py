"""Typed errors of the parameter server.

Every message says what to change; every error is raised before any stored
version is touched, so a caller can catch it and carry on.
"""

from __future__ import annotations


class ParameterServerError(Exception):
    """Base class of every error the parameter server raises on purpose."""


class LayoutError(ParameterServerError, ValueError):
    """A layout (or a slice of it) is malformed."""


class LayoutMismatchError(ParameterServerError, ValueError):
    """Weights do not match the registered layout (names, shapes or dtypes)."""


class DestinationError(ParameterServerError, ValueError):
    """A Pull destination has the wrong size, dtype or memory order."""


class VersionNotHeldError(ParameterServerError, LookupError):
    """A Pull asked for a version the store does not (or no longer) hold."""

    def __init__(
        self, version: int | None, held: tuple[int, ...], message: str | None = None
    ) -> None:
        self.version = version
        self.held = held
        if message is not None:
            msg = message
        elif version is None:
            msg = "no version has been pushed yet; Push version 0 before the first Pull"
        else:
            msg = (
                f"version {version} is not held (held: {list(held)}); Pull one of those, "
                "or Pull the latest with version=None"
            )
        super().__init__(msg)


class BaseWeightsError(ParameterServerError, LookupError):
    """The base weights of an adapter layout are not there yet, or were published already
    (they are written once per store)."""


class PushVersionError(ParameterServerError, ValueError):
    """A Push named a version other than the next one."""


class PushInProgressError(ParameterServerError, RuntimeError):
    """A second Push started before the first one committed or aborted."""


class TransportError(ParameterServerError, RuntimeError):
    """A transport failed to move bytes or lost its peer."""


class TransportUnavailableError(TransportError):
    """A transport cannot be used here (missing package, other host, ...)."""


class WorkerError(ParameterServerError, RuntimeError):
    """A parameter-server worker process failed to start or stopped unexpectedly."""
