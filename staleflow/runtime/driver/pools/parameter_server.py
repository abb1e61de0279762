"""The parameter-server pool: one replica on every node that runs a rollout instance
(App. A.1, fully replicated). An instance Pulls from the replica on its own node over
shared memory; the trainer Pushes to every replica, across nodes over NIXL or TCP,
following the Push plan (App. A.2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parameter_server.replicas import TRANSPORT_LINKS, ReplicaRoute, push_plan, replica_group
from staleflow.runtime.driver.pools import PoolContext, respawn
from staleflow.runtime.workers.actors import ParameterServerActor, process_env

if TYPE_CHECKING:
    from parameter_server.layout import Layout
    from parameter_server.replicas import ReplicaRoute
    from parameter_server.store import Weights
    from parameter_server.transport.base import Endpoint
    from staleflow.config import PSConfig


@dataclass(frozen=True)
class PSPool:
    config: PSConfig
    actors: dict[str, Any]  # role (ps/<k>) -> ParameterServerActor (replaced on restart)
    endpoints: dict[str, Endpoint]
    nodes: Mapping[str, str]  # role -> node id
    args: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # role -> actor args

    def route(self, replica: str, from_node: str) -> ReplicaRoute:
        """How a client on ``from_node`` reaches ``replica``."""

        same = self.nodes[replica] == from_node
        transport = self.config.transport if same else self.config.push_transport
        return ReplicaRoute(replica, self.endpoints[replica], same, transport)

    def local(self, node: str) -> ReplicaRoute:
        """The route to the replica on ``node`` (an instance's Pull)."""
        (replica,) = [r for r, n in self.nodes.items() if n == node]
        return self.route(replica, node)

    def routes(self, node: str) -> list[ReplicaRoute]:
        """Routes from ``node`` to every replica (a trainer rank's Push)."""
        return [self.route(replica, node) for replica in self.actors]

    @property
    def first(self) -> Any:
        return next(iter(self.actors.values()))


def build_parameter_server(
    ctx: PoolContext,
    config: PSConfig,
    layout: Layout,
    weights: Weights,
    version: int = 0,
    base: tuple[Layout, Weights] | None = None,
) -> PSPool:
    """Start the replicas and publish ``weights`` as ``version`` on all of them (0, or
    a resumed run's trainer version). With ``base`` (its layout and weights:
    ``trainer.lora``), ``weights`` is the adapter and the replicas hold that base once."""

    trainer_nodes = set(ctx.placement.gang("trainer").nodes)
    actors, nodes, args = {}, {}, {}
    for placed in ctx.placement.pool("parameter_server"):
        (role,) = placed.gang.roles
        node = placed.nodes[0]
        # a replica registers its memory with NIXL when a Push may come over it
        nixl = config.transport == "nixl" or (
            config.push_transport != "socket" and bool(trainer_nodes - {node})
        )
        args[role] = (
            layout.to_dict(),
            config.num_slots,
            nixl,
            ctx.multi_node,
            None if base is None else base[0].to_dict(),
        )
        actors[role] = ctx.spawn(ParameterServerActor, role, process_env(1)).remote(*args[role])
        nodes[role] = node
    endpoints = dict(
        zip(actors, ctx.ray.get([a.endpoint.remote() for a in actors.values()]), strict=True)
    )
    pool = PSPool(config, actors, endpoints, nodes, args)
    # the driver's one Push of the initial weights: TCP to another node is enough
    routes = [
        ReplicaRoute(
            r,
            endpoints[r],
            nodes[r] == ctx.driver_node,
            "auto" if nodes[r] == ctx.driver_node else "socket",
        )
        for r in actors
    ]
    with replica_group(routes, receiver="driver") as group:
        if base is not None:
            group.push_base(base[1])
        group.push(weights, version)
    return pool


def respawn_replica(ctx: PoolContext, pool: PSPool, role: str) -> Any:
    """Start replica ``role`` again after its actor died (same bundle, same Ray name, so
    clients find it through ``staleflow.runtime.workers.ps_healing.ReplicaResolver``). It comes
    up empty: the trainer refills it. Returns the new actor once it serves."""
    actor = respawn(
        lambda: ctx.spawn(ParameterServerActor, role, process_env(1)).remote(*pool.args[role])
    )
    pool.endpoints[role] = ctx.ray.get(actor.endpoint.remote())
    pool.actors[role] = actor
    return actor


def describe_weights(
    pool: PSPool,
    pulls: Mapping[str, tuple[str, str]],
    pushes: Mapping[str, Mapping[str, str]],
    layout: Layout,
    trainer_nodes: Mapping[str, str],
    sent: Mapping[str, Mapping[str, int]] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """The replicas, every instance's Pull, and the Push plan with the transports really
    chosen: lines for the terminal and plain data for the dashboard.

    ``pulls``: instance role -> (replica, transport); ``pushes``: trainer rank -> replica ->
    transport; ``trainer_nodes``: trainer rank -> node id; ``sent``: trainer rank -> replica
    -> bytes per version, where the trainer ranks plan their own sharded Push (else every
    rank holds the whole ``layout`` and App. A.2's plan assigns it here).
    """

    moved: dict[tuple[str, str], int] = {}
    if sent is None:
        senders = {rank: layout.slices() for rank in pushes}
        plan = push_plan(
            layout, senders, {rank: pool.routes(node) for rank, node in trainer_nodes.items()}
        )
        for t in plan.transfers:
            moved[(t.sender, t.receiver)] = moved.get((t.sender, t.receiver), 0) + t.slice.nbytes
        estimate, how = plan.makespan_s, "App. A.2"
    else:
        moved = {(s, r): n for s, by in sent.items() for r, n in by.items()}
        load: dict[str, float] = {}
        for (s, r), n in moved.items():
            load[s] = load.get(s, 0.0) + TRANSPORT_LINKS[pushes[s][r]].estimate(n)
        estimate, how = max(load.values(), default=0.0), "each rank's own shards, App. A.2"
    replicas = ", ".join(f"{r} on node {n[:8]}" for r, n in pool.nodes.items())
    lines = [
        f"PS: {len(pool.nodes)} replica(s), one per rollout node ({replicas})",
        "Pull: "
        + ", ".join(f"{inst} <- {rep} over {tr}" for inst, (rep, tr) in sorted(pulls.items())),
        f"Push plan ({how}, est. {estimate * 1e3:.1f} ms a version): "
        + ", ".join(
            f"{s} -> {r} {n / 2**20:.1f} MiB over {pushes[s][r]}" for (s, r), n in moved.items()
        ),
    ]
    data = {
        "replicas": dict(pool.nodes),
        "pull": {inst: {"replica": rep, "transport": tr} for inst, (rep, tr) in pulls.items()},
        "push": [
            {"sender": s, "replica": r, "bytes": n, "transport": pushes[s][r]}
            for (s, r), n in moved.items()
        ],
        "push_estimate_s": estimate,
    }
    return lines, data
