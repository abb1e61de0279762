"""Rollout instances: one engine behind a generation thread, seen by the coordinator as
the five snapshot fields of §5.2 and driven by Route / Interrupt / Abort / Pull."""

from staleflow.rollout.instance import Finished, InstanceTimes, RolloutInstance

__all__ = ["Finished", "InstanceTimes", "RolloutInstance"]
