"""What each pool asks the Ray cluster for, and which node group it may run on.

One section per pool under ``resources``: every member of a pool (a TP rank of a rollout
instance, a trainer rank, a reward worker, a PS replica, the control actor and the
trajectory server) asks for ``cpus`` (and ``gpus`` where a pool can use them) in its
placement-group bundle. ``node_resource`` and ``node_label`` pin a pool to a node group:
a custom Ray resource the group's nodes advertise (``ray start --resources``) or a Ray node
label (``ray start --labels``). ``staleflow.runtime.placement.plan`` turns this section into
the placement plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

from staleflow.config.checks import (
    MAX_NODE_GPUS,
    MAX_THREADS,
    MAX_WAIT_S,
    NODE_GPUS_WHY,
    WAIT_WHY,
)
from staleflow.config.sections import _help, require
from staleflow.config.walk import check_types

# Ray's own resource names; a node group is named by a custom resource of its own.
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# Ray node labels follow Kubernetes' syntax: an optional DNS prefix, then a name.
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_RESOURCE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def split_label(text: str) -> tuple[str, str]:
    """``"staleflow.io/pool=rollout"`` -> ``("staleflow.io/pool", "rollout")``."""
    key, _, value = text.partition("=")
    return key.strip(), value.strip()


@dataclass(frozen=True, slots=True)
class CpuPool:
    """A pool of CPU-only members."""

    KEY: ClassVar[str] = "resources"

    cpus: float = field(
        default=1.0,
        metadata=_help(
            "CPU cores reserved for each member of the pool",
            float(MAX_THREADS),
            "CPU cores of one bundle, on one node: no node has more",
        ),
    )
    node_resource: str = field(
        default="",
        metadata=_help(
            "custom Ray resource that the pool's node group advertises (ray start "
            "--resources='{\"NAME\": 1}'); each member asks 0.001 of it; '' = any node"
        ),
    )
    node_label: str = field(
        default="",
        metadata=_help(
            "Ray node label KEY=VALUE of the pool's node group (ray start --labels); '' = any node"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require(
            math.isfinite(self.cpus) and self.cpus >= 0,
            f"{self.KEY}.cpus",
            self.cpus,
            "must be >= 0 CPU cores, e.g. 1",
        )
        if self.node_resource:
            require(
                bool(_RESOURCE.fullmatch(self.node_resource))
                and self.node_resource not in RAY_RESOURCES,
                f"{self.KEY}.node_resource",
                self.node_resource,
                "is not a custom Ray resource name: use letters, digits and _ . -, not "
                f"{' | '.join(RAY_RESOURCES)} (set cpus/gpus for those)",
            )
        if self.node_label:
            key, value = split_label(self.node_label)
            require(
                "=" in self.node_label
                and bool(_LABEL_KEY.fullmatch(key))
                and bool(_LABEL_VALUE.fullmatch(value))
                and not key.startswith("ray.io/"),
                f"{self.KEY}.node_label",
                self.node_label,
                "is not KEY=VALUE of a Ray node label, e.g. staleflow.io/pool=rollout "
                "(ray.io/ labels are Ray's own)",
            )


@dataclass(frozen=True, slots=True)
class GpuPool(CpuPool):
    """A pool whose members may also hold GPUs."""

    gpus: float = field(
        default=0.0,
        metadata=_help(
            "GPUs reserved for each member of the pool", float(MAX_NODE_GPUS), NODE_GPUS_WHY
        ),
    )

    def __post_init__(self) -> None:
        CpuPool.__post_init__(self)
        require(
            math.isfinite(self.gpus) and self.gpus >= 0,
            f"{self.KEY}.gpus",
            self.gpus,
            "must be >= 0 GPUs, e.g. 1 (0 on a CPU-only cluster)",
        )


@dataclass(frozen=True, slots=True)
class RolloutResources(GpuPool):
    """Each TP rank of a rollout instance (``rollout.tensor_parallel`` ranks, one node)."""

    KEY: ClassVar[str] = "resources.rollout"


@dataclass(frozen=True, slots=True)
class TrainerResources(GpuPool):
    """Each trainer rank (the embedded trainer has one)."""

    KEY: ClassVar[str] = "resources.trainer"


@dataclass(frozen=True, slots=True)
class RewardResources(GpuPool):
    """Each reward worker (``reward.workers``)."""

    KEY: ClassVar[str] = "resources.reward"


@dataclass(frozen=True, slots=True)
class PSResources(CpuPool):
    """Each parameter-server replica: one on every node that runs a rollout instance."""

    KEY: ClassVar[str] = "resources.parameter_server"


@dataclass(frozen=True, slots=True)
class ControlResources(CpuPool):
    """Each of the control actor (staleness manager + coordinator) and the trajectory
    server; both go on one node."""

    KEY: ClassVar[str] = "resources.control"


@dataclass(frozen=True, slots=True)
class ResourcesConfig:
    """What every pool asks the Ray cluster for (docs/cluster.md)."""

    KEY: ClassVar[str] = "resources"

    rollout: RolloutResources = field(default_factory=RolloutResources)
    trainer: TrainerResources = field(default_factory=TrainerResources)
    reward: RewardResources = field(default_factory=RewardResources)
    parameter_server: PSResources = field(default_factory=PSResources)
    control: ControlResources = field(default_factory=ControlResources)
    placement_timeout_s: float = field(
        default=60.0,
        metadata=_help(
            "seconds to wait for Ray to reserve the placement once the cluster was found "
            "to hold it (another job may take the room meanwhile); then the launch stops "
            "naming what is still pending",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require(
            math.isfinite(self.placement_timeout_s) and self.placement_timeout_s > 0,
            "resources.placement_timeout_s",
            self.placement_timeout_s,
            "must be > 0 seconds, e.g. 60",
        )
