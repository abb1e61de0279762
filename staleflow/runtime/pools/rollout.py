"""The rollout pool: one actor per instance, in the first bundle of its placement group,
Pulling from the PS replica on its own node; its engine comes from the build hook that
``rollout.backend`` names (:data:`staleflow.runtime.backends.ENGINE_BUILDERS`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from staleflow.runtime.actors import RolloutActor, process_env
from staleflow.runtime.backends import engine_builder
from staleflow.runtime.components import EnginePlacement, RolloutSpec
from staleflow.runtime.pools import PoolContext
from staleflow.runtime.pools.control import ControlPool
from staleflow.runtime.pools.parameter_server import PSPool


def build_rollout(
    ctx: PoolContext, spec: RolloutSpec, ps: PSPool, control: ControlPool, rewards: Sequence[Any]
) -> dict[int, Any]:
    """The instances, once each has built its engine and loaded version 0."""
    builder = engine_builder(spec.rollout.backend)
    env = process_env(spec.rollout.num_threads)
    instances = {}
    for i, placed in enumerate(ctx.placement.pool("rollout")):
        role = placed.gang.roles[0]
        pull = ps.local(placed.nodes[0])
        placement = EnginePlacement(
            ctx.reservation.group(placed.gang.name),
            tuple(range(1, len(placed.gang.roles))),
            inst=i,
            pull=pull,
        )
        instances[i] = ctx.spawn(RolloutActor, role, env).remote(
            i, spec, pull, control.ts.handle, list(rewards), builder, placement
        )
    ctx.ray.get([h.times.remote() for h in instances.values()])  # built and serving
    return instances
