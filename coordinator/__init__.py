"""The rollout coordinator: the snapshot-command cycle and its strategies (paper §5.2, §5.3,
Appendices B and D). Pure Python over plain data; executors carry the commands out."""

from coordinator.commands import (
    Abort,
    Command,
    CommandDone,
    Interrupt,
    Pull,
    Reservation,
    Route,
)
from coordinator.config import (
    AgenticRulesConfig,
    ConfigError,
    CoordinatorConfig,
    CostModelConfig,
    FreshnessConfig,
    RaceConfig,
    SeerConfig,
)
from coordinator.cost_model import PRESETS, QWEN3_30B_A3B_H20, CostModel
from coordinator.cycle import Coordinator, CycleStats, plan_cycle
from coordinator.executor import InProcessExecutor
from coordinator.interface import (
    AdmissionSource,
    CommandExecutor,
    EnginePlane,
    ParameterPlane,
    ParameterVersionSource,
    SnapshotSource,
    TrajectoryPlane,
    TrajectorySource,
)
from coordinator.profiler import CostModelFit, LatencySample, fit_cost_model, profile, profile_grid
from coordinator.speculative import Mismatch, SpeculativeState
from coordinator.strategies import Strategies, build_strategies
from coordinator.types import InstanceId, InstanceSnapshot, Snapshot, TrajectoryView, TrajRecord

__all__ = [
    "PRESETS",
    "QWEN3_30B_A3B_H20",
    "Abort",
    "AdmissionSource",
    "AgenticRulesConfig",
    "Command",
    "CommandDone",
    "CommandExecutor",
    "ConfigError",
    "Coordinator",
    "CoordinatorConfig",
    "CostModel",
    "CostModelConfig",
    "CostModelFit",
    "CycleStats",
    "EnginePlane",
    "FreshnessConfig",
    "InProcessExecutor",
    "InstanceId",
    "InstanceSnapshot",
    "Interrupt",
    "LatencySample",
    "Mismatch",
    "ParameterPlane",
    "ParameterVersionSource",
    "Pull",
    "RaceConfig",
    "Reservation",
    "Route",
    "SeerConfig",
    "Snapshot",
    "SnapshotSource",
    "SpeculativeState",
    "Strategies",
    "TrajRecord",
    "TrajectoryPlane",
    "TrajectorySource",
    "TrajectoryView",
    "build_strategies",
    "fit_cost_model",
    "plan_cycle",
    "profile",
    "profile_grid",
]
