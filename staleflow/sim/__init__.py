"""Discrete-event cluster simulator: the real staleness manager, trajectory server and
coordinator drive simulated rollout instances and a simulated trainer on a virtual clock.

Pure Python and numpy (no ray, torch or engines). See ``docs/simulator.md``.
"""

from staleflow.sim.cluster import ClusterConfig, SimCluster
from staleflow.sim.engine import EngineCosts, SimInstance, SimTrajectory
from staleflow.sim.presets import PRESETS, SYSTEMS, paper_6_5, system, tiny
from staleflow.sim.summary import Summary
from staleflow.sim.trainer import SimTrainer, TrainerCosts
from staleflow.sim.workload import (
    SimSample,
    SyntheticWorkload,
    TraceError,
    TraceGroup,
    TraceWorkload,
    WorkloadConfig,
    read_trace,
)


def simulate(config: ClusterConfig, workload: TraceWorkload | None = None) -> Summary:
    """Run one simulation to ``config.steps`` training steps and summarise it."""
    return SimCluster(config, workload).run()


__all__ = [
    "PRESETS",
    "SYSTEMS",
    "ClusterConfig",
    "EngineCosts",
    "SimCluster",
    "SimInstance",
    "SimSample",
    "SimTrainer",
    "SimTrajectory",
    "Summary",
    "SyntheticWorkload",
    "TraceError",
    "TraceGroup",
    "TraceWorkload",
    "TrainerCosts",
    "WorkloadConfig",
    "paper_6_5",
    "read_trace",
    "simulate",
    "system",
    "tiny",
]
