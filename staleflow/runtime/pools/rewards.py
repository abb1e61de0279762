"""The reward pool: ``reward.workers`` actors grading finished responses on CPU."""

from __future__ import annotations

from typing import Any

from staleflow.runtime.actors import RewardActor, process_env
from staleflow.runtime.components import RewardSpec
from staleflow.runtime.pools import PoolContext
from staleflow.runtime.pools.control import ControlPool


def build_rewards(ctx: PoolContext, spec: RewardSpec, control: ControlPool) -> list[Any]:
    roles = ctx.placement.gang("reward").gang.roles
    return [
        ctx.spawn(RewardActor, role, process_env(1)).remote(
            spec, control.ts.handle, control.control
        )
        for role in roles
    ]
