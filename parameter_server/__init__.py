"""Parameter server: a versioned CPU copy of the policy weights (paper §5.1, App. A).

Trainers Push a new version (in the background, overlapped with the next step);
rollout instances Pull a given or the latest version, never a mix of two. The
core is numpy only; transports (shared memory, NIXL, socket) and the worker
process sit behind :mod:`parameter_server.transport` and
:mod:`parameter_server.worker`, imported on demand.
"""

from parameter_server.errors import (
    DestinationError,
    LayoutError,
    LayoutMismatchError,
    ParameterServerError,
    PushInProgressError,
    PushVersionError,
    TransportError,
    TransportUnavailableError,
    VersionNotHeldError,
    WorkerError,
)
from parameter_server.layout import Layout, ParamSpec, Slice, common_granularity
from parameter_server.plan import CommPlan, Link, Planner, Transfer, build_plan
from parameter_server.push import BackgroundPusher, PushHandle
from parameter_server.store import ReadLease, StoreInfo, VersionedStore, WriteLease

__all__ = [
    "BackgroundPusher",
    "CommPlan",
    "DestinationError",
    "Layout",
    "LayoutError",
    "LayoutMismatchError",
    "Link",
    "ParamSpec",
    "ParameterServerError",
    "Planner",
    "PushHandle",
    "PushInProgressError",
    "PushVersionError",
    "ReadLease",
    "Slice",
    "StoreInfo",
    "Transfer",
    "TransportError",
    "TransportUnavailableError",
    "VersionNotHeldError",
    "VersionedStore",
    "WorkerError",
    "WriteLease",
    "build_plan",
    "common_granularity",
]
