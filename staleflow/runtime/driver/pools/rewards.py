"""The reward pool: ``reward.workers`` actors grading finished responses on CPU.

Each incarnation of worker ``reward/<w>`` is named ``reward/<w>.<k>`` in the TS (its
worker id), so that a restarted worker's predecessor cannot complete what was reassigned
(``docs/recovery.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from staleflow.runtime.driver.pools import PoolContext, respawn
from staleflow.runtime.driver.pools.controller import ControlPool
from staleflow.runtime.workers.actors import RewardActor, process_env
from staleflow.runtime.workers.specs import RewardSpec


@dataclass
class RewardPool:
    spec: RewardSpec
    roles: tuple[str, ...]
    workers: dict[str, Any] = field(default_factory=dict)  # worker id -> RewardActor
    role_of: dict[str, str] = field(default_factory=dict)  # worker id -> role
    tag: str = ""

    def live(self) -> dict[str, Any]:
        return dict(self.workers)


def worker_id(role: str, incarnation: int, tag: str = "") -> str:
    return f"{role}.{incarnation}" + (f"@{tag}" if tag else "")


def build_rewards(
    ctx: PoolContext, spec: RewardSpec, control: ControlPool, tag: str = ""
) -> RewardPool:
    pool = RewardPool(spec, ctx.placement.gang("reward").gang.roles, tag=tag)
    for role in pool.roles:
        spawn_worker(ctx, pool, role, 0, control)
    return pool


def spawn_worker(
    ctx: PoolContext, pool: RewardPool, role: str, incarnation: int, control: ControlPool
) -> str:
    """Start incarnation ``incarnation`` of worker ``role``; returns its worker id."""
    wid = worker_id(role, incarnation, pool.tag)
    # an environment task's worker takes the next batch of turns while a tool of the
    # last one is still waiting: its steps share the stage's threads (env.threads)
    extra = {"max_concurrency": pool.spec.env.threads} if pool.spec.env is not None else {}
    actor = respawn(
        lambda: ctx.spawn(RewardActor, role, process_env(1), **extra).remote(
            pool.spec, control.ts.handle, control.control, wid
        )
    )
    pool.workers[wid] = actor
    pool.role_of[wid] = role
    return wid
