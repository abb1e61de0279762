"""The three strategy slots of Algorithm 1 and their construction from configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from coordinator.config import CoordinatorConfig
from coordinator.cost_model import CostModel
from coordinator.drain_sync import DrainGlobalSync
from coordinator.fleet import Fleet
from coordinator.migration import Migration, NoMigration, ThroughputMigration
from coordinator.pool import TrajectoryPool
from coordinator.routing import Placement, ThroughputRouting
from coordinator.sync import GreedySync, ThroughputSync
from coordinator.vanilla_routing import LeastLoadedRouting
from staleness.interface import AdmissionSketch


class SyncStrategy(Protocol):
    def select(
        self, fleet: Fleet, pool: TrajectoryPool, ps_version: int, sketch: AdmissionSketch
    ) -> list[int]:
        """Positions of the instances to Pull. Must not modify ``fleet`` or ``sketch``."""
        ...


class MigrationStrategy(Protocol):
    def select(self, fleet: Fleet) -> list[Migration]:
        """(position, trajectories) to interrupt; the lists are disjoint. Pure."""
        ...


class RoutingStrategy(Protocol):
    def route(self, fleet: Fleet, pool: TrajectoryPool, sketch: AdmissionSketch) -> list[Placement]:
        """Routes for trajectories of ``pool``, each at most once. Updates ``fleet``'s loads
        and Reserves every initial placement in ``sketch``."""
        ...


class RoutingHold(Protocol):
    def holds_routing(self, fleet: Fleet, ps_version: int) -> bool:
        """Skip the routing step this cycle (e.g. instances must drain before a Pull). Pure."""
        ...


@dataclass(frozen=True, slots=True)
class Strategies:
    sync: SyncStrategy
    migration: MigrationStrategy
    routing: RoutingStrategy
    cost: CostModel
    # Set only by synchronisation strategies that need routing to pause (drain-then-Pull);
    # None keeps Algorithm 1 as the paper writes it.
    hold: RoutingHold | None = None


def build_strategies(config: CoordinatorConfig) -> Strategies:
    cost = config.cost_model.build()
    throughput_routing = ThroughputRouting(cost, config.mu)
    routing: RoutingStrategy = (
        throughput_routing if config.routing == "throughput" else LeastLoadedRouting(cost)
    )
    # Algorithm 4's tentative routing is the paper's routing strategy, whichever strategy
    # routes for real: it asks whether a Pull would let throughput-worthy work in.
    sync: SyncStrategy
    hold: RoutingHold | None = None
    if config.synchronization == "throughput":
        # Without proactive migration a Pull is the only way a queue leaves an instance, so
        # the sync strategy then also releases queues beyond phi_wait (sync.py).
        release = config.phi_wait if config.migration == "vanilla" else None
        sync = ThroughputSync(throughput_routing, release)
    elif config.synchronization == "drain":
        drain = DrainGlobalSync()  # it also holds routing until the fleet has drained
        sync, hold = drain, drain
    else:
        sync = GreedySync()
    migration: MigrationStrategy = (
        ThroughputMigration(cost, config.phi_wait, config.phi_throughput)
        if config.migration == "throughput"
        else NoMigration()
    )
    return Strategies(sync=sync, migration=migration, routing=routing, cost=cost, hold=hold)
