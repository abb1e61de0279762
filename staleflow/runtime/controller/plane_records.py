"""The records the control plane hands its callers: its configuration, a consistent cut
of the run to checkpoint, and the live state a dashboard or progress display shows. They
run in the control actor and cross to the driver as plain data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator import CoordinatorConfig
from coordinator.cost_model import SpeculationProfile
from coordinator.types import InstanceSnapshot
from staleflow.control.dynamic_sampling import SamplingConfig
from staleness import StalenessConfig
from staleness.types import ManagerView
from trajectory_server.types import TSStats


@dataclass(frozen=True, slots=True)
class ControlConfig:
    staleness: StalenessConfig
    coordinator: CoordinatorConfig
    idle_wait_s: float = 0.05  # longest sleep between loop iterations
    checkpoint_every: int = 0  # take a cut after every N-th training step (0: never)
    eval_every: int = 0  # hold every N-th step's record for its evaluation (0: never)
    sampling: SamplingConfig | None = None  # dynamic sampling (trainer.dynamic_sampling)
    # a multi-turn task: snapshots list the trajectories waiting on their tools
    # (runtime/controller/tool_view.py); ``prefix_cache``: and the prefixes engines keep
    tool_waits: bool = False
    prefix_cache: bool = False
    # the engines decode speculatively (rollout.speculation): the coordinator's cost model
    # starts from this profile, its acceptance learned from their counters; None: off
    speculation: SpeculationProfile | None = None
    # the draft method a tail-race copy runs with (rollout.speculation.race_method;
    # runtime/controller/races.py); None: the engine's
    race_draft_method: str | None = None


@dataclass(frozen=True, slots=True)
class Cut:
    """The run at a consistent cut, waiting to be written (``staleflow.recovery``)."""

    steps: int
    version: int
    ps_version: int
    staleness: Mapping[str, Any]
    trajectories: Mapping[str, Any]
    metrics: tuple[Mapping[str, float], ...]
    final: bool  # taken because the run is stopping


@dataclass(frozen=True, slots=True)
class LiveState:
    """What a dashboard or progress display shows between steps."""

    buffers: ManagerView
    instances: tuple[InstanceSnapshot, ...]
    ts: TSStats | None
    ps_version: int
    steps: int
    rewarded: int
    elapsed_s: float
    cycles: int = 0
    discarded: int = 0
    last_discard: str = ""  # why the last snapshot failed Eq. 1
    pending: Mapping[int, int] = field(default_factory=dict)  # commands in flight, by instance
    commands: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # issued, by kind
    members: tuple[int, ...] = ()  # the instances in the run now
    stopping: bool = False
    recovery: Mapping[str, float] = field(default_factory=dict)  # recovery/* totals
