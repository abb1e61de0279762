"""The placement plan of a run: which pools, how many members, what each asks for, on
which node group. Pure data, built from the typed configuration; printable and testable
without Ray (``staleflow.runtime.placement.fitting`` fits it to a cluster's nodes,
``staleflow.runtime.placement.ray_cluster`` reserves it with Ray placement groups).

A *gang* is one Ray placement group: its bundles are reserved together. Each rollout
instance is a gang of ``rollout.tensor_parallel`` bundles on one node; the trainer ranks
are one gang; the reward workers one; the control actor and the trajectory server one
(on one node: they talk on every cycle). PS replicas are not listed here: App. A.1 puts
one on every node that runs a rollout instance, so they follow where the rollout gangs
fit (``PlacementPlan.ps_replica`` is what each asks for).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from staleflow.config.resources import CpuPool, GpuPool, split_label
from staleflow.runtime.backends import trainer_backend

if TYPE_CHECKING:
    from staleflow.config import ResourcesConfig, RewardConfig, RolloutConfig, TrainerConfig

# What a bundle asks of its node group's custom resource: any node that advertises the
# resource at all qualifies, and a thousand members fit in one unit of it.
NODE_RESOURCE_SHARE = 0.001
POOLS = ("rollout", "parameter_server", "trainer", "reward", "control")


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """The nodes a pool may use: those advertising ``resource`` and carrying ``label``."""

    resource: str = ""
    label: tuple[str, str] | None = None

    @classmethod
    def of(cls, pool: CpuPool) -> NodeGroup:
        return cls(pool.node_resource, split_label(pool.node_label) if pool.node_label else None)

    def admits(self, resources: Mapping[str, float], labels: Mapping[str, str]) -> bool:
        if self.resource and resources.get(self.resource, 0.0) <= 0:
            return False
        return self.label is None or labels.get(self.label[0]) == self.label[1]

    def describe(self) -> str:
        parts = []
        if self.resource:
            parts.append(f"with resource {self.resource}")
        if self.label is not None:
            parts.append(f"labelled {self.label[0]}={self.label[1]}")
        return "nodes " + " and ".join(parts) if parts else "any node"


@dataclass(frozen=True, slots=True)
class Bundle:
    """What one member of a pool asks for."""

    cpus: float
    gpus: float = 0.0
    group: NodeGroup = NodeGroup()

    @classmethod
    def of(cls, pool: CpuPool) -> Bundle:
        gpus = pool.gpus if isinstance(pool, GpuPool) else 0.0
        return cls(pool.cpus, gpus, NodeGroup.of(pool))

    def resources(self) -> dict[str, float]:
        """The Ray bundle: ``{"CPU": .., "GPU": .., <node resource>: 0.001}``. Ray refuses
        an empty bundle, so one that asks for nothing holds a token share of a CPU."""
        out = {"CPU": self.cpus} if self.cpus else {}
        if self.gpus:
            out["GPU"] = self.gpus
        if self.group.resource:
            out[self.group.resource] = NODE_RESOURCE_SHARE
        return out or {"CPU": NODE_RESOURCE_SHARE}

    def describe(self) -> str:
        text = f"CPU {self.cpus:g}" + (f" GPU {self.gpus:g}" if self.gpus else "")
        return text


@dataclass(frozen=True, slots=True)
class Gang:
    """One placement group: ``roles`` name its bundles in order (the actor of a rollout
    instance takes its first bundle; the others are its TP ranks')."""

    name: str  # rollout/0, trainer, reward, control
    pool: str  # one of POOLS
    roles: tuple[str, ...]
    bundle: Bundle  # what every bundle of the gang asks for
    same_node: bool  # all bundles on one node (STRICT_PACK)

    def total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in self.bundle.resources().items():
            out[key] = out.get(key, 0.0) + value * len(self.roles)
        return out


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    gangs: tuple[Gang, ...]  # rollout gangs first: PS replicas follow them
    ps_replica: Bundle  # one on each node that runs a rollout instance

    def pool(self, pool: str) -> tuple[Gang, ...]:
        return tuple(g for g in self.gangs if g.pool == pool)

    def totals(self, rollout_nodes: int = 1) -> dict[str, float]:
        """Everything the plan asks for with ``rollout_nodes`` PS replicas."""
        out: dict[str, float] = {}
        for part in [g.total() for g in self.gangs] + [
            {k: v * rollout_nodes for k, v in self.ps_replica.resources().items()}
        ]:
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def describe(self) -> list[str]:
        """One line per pool: how many members, what each asks for, on which nodes."""
        rows = []
        for pool in POOLS:
            gangs = self.pool(pool)
            if pool == "parameter_server":
                where = self.ps_replica.group
                rows.append(
                    (
                        pool,
                        "1 per rollout node",
                        self.ps_replica,
                        where.describe() if where != NodeGroup() else "the rollout nodes",
                    )
                )
            elif gangs:
                n = len(gangs[0].roles)
                count = {
                    "rollout": f"{_count(len(gangs), 'instance')} x {_count(n, 'TP rank')}",
                    "trainer": _count(n, "rank"),
                    "reward": _count(n, "worker"),
                    "control": "control + TS",
                }[pool]
                rows.append((pool, count, gangs[0].bundle, gangs[0].bundle.group.describe()))
        width = max(len(count) for _, count, _, _ in rows)
        return [
            f"{pool:<16} {count:<{width}}  {bundle.describe() + ' each':<17} {where}"
            for pool, count, bundle, where in rows
        ]


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What :func:`staleflow.runtime.placement.placing.place` asks of a Ray cluster: the
    plan, the cluster's ``address`` ('' starts a local one) and the CPUs a local one keeps
    free beyond the plan (two more rollout instances, for ``staleflow scale``)."""

    plan: PlacementPlan
    address: str = ""
    spare_cpus: float = 0.0


def plan_placement(
    resources: ResourcesConfig,
    rollout_section: RolloutConfig,
    trainer: TrainerConfig,
    reward: RewardConfig,
    trainer_ranks: int | None = None,
) -> PlacementPlan:
    """The plan of a run's sections: ``trainer_ranks`` comes from the trainer backend (the
    embedded trainer has one rank; a Megatron pool has TP x PP x DP), asked of its registry
    entry when not given."""
    if trainer_ranks is None:
        trainer_ranks = trainer_backend(trainer.backend).ranks(trainer)
    res = resources
    rollout = Bundle.of(res.rollout)
    tp = rollout_section.tensor_parallel
    gangs = [
        Gang(
            f"rollout/{i}",
            "rollout",
            (f"instance/{i}", *(f"instance/{i}/tp{r}" for r in range(1, tp))),
            rollout,
            same_node=True,
        )
        for i in range(rollout_section.instances)
    ]
    gangs.append(
        Gang(
            "trainer",
            "trainer",
            tuple(f"trainer/{r}" for r in range(trainer_ranks)),
            Bundle.of(res.trainer),
            same_node=False,
        )
    )
    gangs.append(
        Gang(
            "reward",
            "reward",
            tuple(f"reward/{w}" for w in range(reward.workers)),
            Bundle.of(res.reward),
            same_node=False,
        )
    )
    gangs.append(Gang("control", "control", ("control", "ts"), Bundle.of(res.control), True))
    return PlacementPlan(tuple(gangs), Bundle.of(res.parameter_server))
