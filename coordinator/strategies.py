"""The three strategy slots of Algorithm 1 and their construction from configuration."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Protocol

from coordinator.agentic import ToolWaits, expected_returns
from coordinator.config import CoordinatorConfig
from coordinator.cost_model import CostModel, SpeculationProfile
from coordinator.critical import CriticalPath
from coordinator.drain_sync import DrainGlobalSync
from coordinator.estimation import SpeedEstimator
from coordinator.fleet import Fleet
from coordinator.freshness import FreshnessRule
from coordinator.migration import Migration, NoMigration, ThroughputMigration
from coordinator.pool import TrajectoryPool
from coordinator.race import TailRace
from coordinator.routing import RoutingStrategy, ThroughputRouting
from coordinator.seer import LengthContext, SeerRouting
from coordinator.sync import GreedySync, ThroughputSync
from coordinator.vanilla_routing import LeastLoadedRouting
from staleness.interface import AdmissionSketch
from staleness.types import TrajId


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
    # Per-instance speed learned from snapshots (coordinator/estimation.py); None: every
    # instance follows the profiled cost model.
    estimator: SpeedEstimator | None = None
    # The oldest buffer's tail moved where it finishes soonest (coordinator/critical.py).
    critical: CriticalPath | None = None
    # Seer's length context (coordinator/seer.py), fed with finished lengths by the control
    # loop; None when Seer's scheduling is off.
    seer: LengthContext | None = None
    # SpecActor's tail race (coordinator/race.py). Not a step of Algorithm 1: copies are
    # no trajectories of their destination, so whoever runs them applies its decisions
    # after the cycle (the simulator so far); None when off.
    race: TailRace | None = None
    # eta as a ceiling (coordinator/freshness.py): new groups held back until they must
    # start; fed by the control loop; None when off.
    freshness: FreshnessRule | None = None
    # Environment waits of multi-turn work, learned from the snapshots (coordinator/
    # agentic.py); None when no rule of coordinator.agentic uses them.
    waits: ToolWaits | None = None


def build_strategies(
    config: CoordinatorConfig, speculation: SpeculationProfile | None = None
) -> Strategies:
    """The strategies ``config`` names, deciding with its cost model and, where the
    engines decode speculatively, ``speculation`` (coordinator/cost_model.py)."""
    cost = config.cost_model.build().with_speculation(speculation)
    # Fresh admission is a rule of the throughput routing; Algorithm 4's tentative pass
    # must admit as the real routing does, so behind least-loaded routing it is off.
    fresh = config.fresh_admission and config.routing == "throughput"
    agentic = config.agentic
    uses_waits = agentic.any and "throughput" in (config.routing, config.synchronization)
    waits = (
        ToolWaits(
            prior_wait_s=agentic.prior_wait_s, prior_turn_tokens=float(agentic.prior_turn_tokens)
        )
        if uses_waits
        else None
    )
    throughput_routing = ThroughputRouting(
        cost,
        config.mu,
        config.fill_steps,
        fresh=fresh,
        whole_groups=config.whole_groups,
        waits=waits,
        locality=waits is not None and agentic.kv_locality,
        home_below=agentic.home_below,
        returns=waits is not None and agentic.expected_returns,
    )
    routing: RoutingStrategy = (
        throughput_routing
        if config.routing == "throughput"
        else LeastLoadedRouting(cost, sticky=config.routing == "sticky")
    )
    # Algorithm 4's tentative routing is the paper's routing strategy, whichever strategy
    # routes for real: it asks whether a Pull would let throughput-worthy work in.
    sync: SyncStrategy
    hold: RoutingHold | None = None
    if config.synchronization == "throughput":
        # Without proactive migration a Pull is the only way a queue leaves an instance, so
        # the sync strategy then also releases queues beyond phi_wait (sync.py).
        release = config.phi_wait if config.migration == "vanilla" else None
        # Deferred Pulls wait for a lagging instance's KV to drain, which only the
        # throughput routing guarantees (Eq. 3 never routes into a queue). Least-loaded
        # routing queues every admissible trajectory on the instances, so their KV stays
        # full and a deferred Pull comes late or never (R0S1M1 made 0.86x R0S0M0 with it,
        # 1.03x without: docs/simulator.md, Strategies).
        pull_kv = config.pull_kv if config.routing == "throughput" else None
        # Holding the instances that run the critical tail is a deferred Pull too.
        held_tail = config.critical_tail if pull_kv is not None else None
        sync = ThroughputSync(
            throughput_routing,
            release,
            pull_kv,
            held_tail,
            config.agentic.tool_critical,
            waits is not None and config.agentic.tool_pulls,
        )
    elif config.synchronization == "drain":
        drain = DrainGlobalSync()  # it also holds routing until the fleet has drained
        sync, hold = drain, drain
    else:
        sync = GreedySync()
    # Trajectories just moved, by migration or the critical-path rule: neither moves one
    # again before it has decoded where it went (migration.py).
    moved_at: dict[TrajId, int] = {}
    migration: MigrationStrategy = (
        ThroughputMigration(
            cost,
            config.phi_wait,
            config.phi_throughput,
            config.mu if config.improving_moves else None,
            moved_at,
            (
                partial(expected_returns, waits=waits, cost=cost)
                if waits is not None and agentic.expected_returns
                else None
            ),
        )
        if config.migration == "throughput"
        else NoMigration()
    )
    # Only the throughput-oriented strategies compare instances by speed; an all-vanilla
    # combination has no use for the estimate.
    uses_speed = "throughput" in (config.routing, config.synchronization, config.migration)
    estimator = SpeedEstimator(cost) if config.estimation and uses_speed else None
    # The critical-path rule moves trajectories: part of the throughput migration slot.
    critical = (
        CriticalPath(
            cost,
            speedup=config.critical_speedup,
            fill_steps=config.fill_steps or 0,
            tail=config.critical_tail,
            moved_at=moved_at,
            waiting=config.agentic.tool_critical,
        )
        if config.critical_speedup is not None and config.migration == "throughput"
        else None
    )
    seer = LengthContext() if config.seer.enabled else None
    if seer is not None:
        routing = SeerRouting(routing, seer)
    race = (
        TailRace(cost, copies=config.race.copies, fill_steps=config.fill_steps or 0)
        if config.race.enabled
        else None
    )
    fresh_cfg = config.freshness
    freshness = (
        FreshnessRule(cost, quantile=fresh_cfg.quantile, give_way=fresh_cfg.give_way)
        if fresh_cfg.enabled
        else None
    )
    return Strategies(
        sync=sync,
        migration=migration,
        routing=routing,
        cost=cost,
        hold=hold,
        estimator=estimator,
        critical=critical,
        seer=seer,
        race=race,
        freshness=freshness,
        waits=waits,
    )


def with_cost(strategies: Strategies, cost: CostModel) -> Strategies:
    """``strategies``, with what they learned (speed factors, tool waits, lateness, ...),
    deciding with ``cost`` from now on: every part that holds the cost model gets it
    (e.g. the engines' measured speculative acceptance, ``Coordinator.speculate``)."""
    if cost == strategies.cost:
        return strategies
    for part in _parts(strategies, set()):
        if part is not strategies and isinstance(getattr(part, "cost", None), CostModel):
            part.cost = cost  # type: ignore[attr-defined]
    return replace(strategies, cost=cost)


def _parts(obj: object, seen: set[int]) -> Iterator[object]:
    """The coordinator's objects reachable from ``obj`` through their attributes (a
    strategy wraps another, a sync strategy holds the routing it asks), each once."""
    if id(obj) in seen or not type(obj).__module__.startswith("coordinator."):
        return
    seen.add(id(obj))
    yield obj
    names: list[str] = [f.name for f in fields(obj)] if hasattr(obj, "__dataclass_fields__") else []
    names += list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if isinstance(n, str)]
    for name in dict.fromkeys(names):
        yield from _parts(getattr(obj, name, None), seen)
