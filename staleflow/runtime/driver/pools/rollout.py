"""The rollout pool: one actor per instance, in the first bundle of its placement group,
Pulling from the PS replica on its own node; its engine comes from the build hook that
``rollout.backend`` names (:data:`staleflow.runtime.backends.ENGINE_BUILDERS`).

Every incarnation of instance ``i`` is named ``i.<k>`` in the TS (its holder id), so
that the messages of one declared lost are refused there; a restart or an instance added
to a live run (elastic rollout) goes through :func:`spawn_instance` like the first ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from staleflow.runtime.backends import engine_builder
from staleflow.runtime.driver.pools import PoolContext, respawn
from staleflow.runtime.driver.pools.controller import ControlPool
from staleflow.runtime.driver.pools.parameter_server import PSPool
from staleflow.runtime.errors import LaunchError
from staleflow.runtime.placement.plan import NODE_RESOURCE_SHARE, Bundle
from staleflow.runtime.placement.ray_cluster import NODE_ID_LABEL
from staleflow.runtime.workers.actors import InstanceRecovery, RolloutActor, process_env
from staleflow.runtime.workers.specs import EnginePlacement, RolloutSpec


def holder_id(inst: int, incarnation: int, tag: str = "") -> str:
    """The TS holder id of one incarnation of instance ``inst``; ``tag`` tells launches of
    the same run folder apart (a resumed run's first incarnations are new ones too)."""
    return f"{inst}.{incarnation}" + (f"@{tag}" if tag else "")


@dataclass(frozen=True)
class Slot:
    """Where an instance runs: its placement group and bundles, the node, its role."""

    role: str
    node: str
    options: Mapping[str, Any]  # Ray actor options that put it in its bundle
    placement: EnginePlacement
    owned: bool = False  # a placement group made for an added instance (removed with it)


@dataclass
class RolloutPool:
    spec: RolloutSpec
    builder: str
    recovery: InstanceRecovery
    actors: dict[int, Any]  # instance -> RolloutActor
    holders: dict[int, str]
    slots: dict[int, Slot]
    tag: str = ""


def plan_slots(ctx: PoolContext, ps: PSPool) -> list[Slot]:
    """The rollout gangs of the placement, one slot each, Pulling from the PS replica on
    its node."""
    out = []
    for i, placed in enumerate(ctx.placement.pool("rollout")):
        role = placed.gang.roles[0]
        node = placed.nodes[0]
        out.append(
            Slot(
                role,
                node,
                ctx.options(role, process_env(1)),
                EnginePlacement(
                    ctx.reservation.group(placed.gang.name),
                    tuple(range(1, len(placed.gang.roles))),
                    inst=i,
                    pull=ps.local(node),
                ),
            )
        )
    return out


def build_rollout(
    ctx: PoolContext,
    spec: RolloutSpec,
    ps: PSPool,
    control: ControlPool,
    rewards: Mapping[str, Any],
    recovery: InstanceRecovery,
    *,
    at_least: int = 0,
    tag: str = "",
) -> RolloutPool:
    """The instances, once each has built its engine and loaded ``at_least`` or newer."""
    pool = RolloutPool(spec, engine_builder(spec.rollout.backend), recovery, {}, {}, {}, tag)
    for i, slot in enumerate(plan_slots(ctx, ps)):
        pool.slots[i] = slot
        spawn_instance(ctx, pool, i, 0, ps, control, rewards, at_least)
    ctx.ray.get([h.times.remote() for h in pool.actors.values()])  # built and serving
    return pool


def spawn_instance(
    ctx: PoolContext,
    pool: RolloutPool,
    inst: int,
    incarnation: int,
    ps: PSPool,
    control: ControlPool,
    rewards: Mapping[str, Any],
    at_least: int,
) -> Any:
    """Start incarnation ``incarnation`` of instance ``inst`` in its slot; it Pulls
    ``at_least`` or newer before it serves. Returns the actor (not waited for)."""
    slot = pool.slots[inst]
    env = process_env(pool.spec.rollout.num_threads)
    options = {**slot.options, "runtime_env": {"env_vars": env}, **ctx.naming(slot.role)}
    holder = holder_id(inst, incarnation, pool.tag)
    actor = respawn(
        lambda: (
            ctx.ray.remote(RolloutActor)
            .options(**options)
            .remote(
                inst,
                pool.spec,
                ps.local(slot.node),
                control.ts.handle,
                dict(rewards),
                pool.builder,
                slot.placement,
                holder,
                pool.recovery,
                at_least,
            )
        )
    )
    pool.actors[inst] = actor
    pool.holders[inst] = holder
    return actor


def new_slot(
    ctx: PoolContext, bundle: Bundle, tp: int, ps: PSPool, inst: int, wait_s: float
) -> Slot:
    """A placement group for one more instance (elastic rollout) of ``tp`` bundles
    (``rollout.tensor_parallel`` of ``resources.rollout``), on a node that runs a PS
    replica (it Pulls from that replica over shared memory). Raises ``LaunchError`` naming
    what is missing when no such node has room within ``wait_s``."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    for node in dict.fromkeys(ps.nodes.values()):
        pg = placement_group(
            [bundle.resources() for _ in range(tp)],
            strategy="STRICT_PACK",
            name=f"{ctx.run}/rollout/{inst}",
            bundle_label_selector=[{NODE_ID_LABEL: node} for _ in range(tp)],
        )
        done, _ = ctx.ray.wait([pg.ready()], timeout=wait_s)
        if not done:
            remove_placement_group(pg)
            continue
        options: dict[str, Any] = {
            "num_cpus": bundle.cpus,
            "num_gpus": bundle.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0
            ),
        }
        if bundle.group.resource:
            options["resources"] = {bundle.group.resource: NODE_RESOURCE_SHARE}
        placement = EnginePlacement(pg, tuple(range(1, tp)), inst=inst, pull=ps.local(node))
        return Slot(f"instance/{inst}", node, options, placement, owned=True)
    raise LaunchError(
        f"no room for another rollout instance ({tp} x {bundle.describe()}) on the nodes "
        f"that run a PS replica within {wait_s:g} s: free resources there, or remove an "
        "instance first"
    )


def release_slot(slot: Slot) -> None:
    """Give back the placement group of an added instance's slot."""
    if slot.owned:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(slot.placement.placement_group)
