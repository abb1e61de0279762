"""The supervisor's faces (:mod:`staleflow.runtime.driver.supervised`) over a run's Ray
pools: thin classes that turn each face's calls into the actors' ``.remote()`` calls and
the pool builders' restarts (``staleflow.runtime.driver.pools``). Every decision stays in
the supervisor; :func:`supervised_pools` is what ``Run`` hands it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from staleflow.runfolder.layout import RunLayout
from staleflow.runtime.driver.pools.parameter_server import respawn_replica
from staleflow.runtime.driver.pools.rewards import spawn_worker
from staleflow.runtime.driver.pools.rollout import release_slot, spawn_instance
from staleflow.runtime.driver.supervised import ActorGone, Handle, Supervised

if TYPE_CHECKING:
    from types import ModuleType

    from staleflow.runtime.driver.pools import PoolContext
    from staleflow.runtime.driver.pools.controller import ControlPool
    from staleflow.runtime.driver.pools.parameter_server import PSPool
    from staleflow.runtime.driver.pools.rewards import RewardPool
    from staleflow.runtime.driver.pools.rollout import RolloutPool, Slot
    from staleflow.runtime.driver.pools.trainer import TrainerPool
    from staleflow.runtime.placement.ray_cluster import RayApi
    from trajectory_server.types import RewardTask

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RayPending(Generic[T]):
    """A Ray ref as a :class:`~staleflow.runtime.driver.supervised.Pending`."""

    def __init__(self, ray: RayApi, ref: object) -> None:  # ref: an ObjectRef
        self._ray, self._ref = ray, ref

    def done(self) -> bool:
        ready, _ = self._ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self, timeout_s: float | None = None) -> T:
        exceptions = self._ray.exceptions
        try:
            return self._ray.get(self._ref, timeout=timeout_s)
        except exceptions.GetTimeoutError as exc:
            raise TimeoutError(str(exc)) from exc
        except exceptions.RayActorError as exc:
            raise ActorGone(str(exc)) from exc


def _kill(ray: ModuleType, actor: object) -> None:
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already gone
        logger.debug("kill: %s", exc)


class RayRolloutFleet:
    """The rollout pool (``RolloutPool``): its instances' actors and slots."""

    def __init__(
        self,
        ctx: PoolContext,
        pool: RolloutPool,
        ps: PSPool,
        control: ControlPool,
        new_slot: Callable[[int], Slot],
    ) -> None:
        self._ctx, self._pool, self._ps, self._control = ctx, pool, ps, control
        self._new_slot = new_slot  # the placement of one more instance (elastic rollout)

    def started(self) -> Collection[int]:
        return list(self._pool.actors)

    def handle(self, inst: int) -> Handle:
        return self._pool.actors[inst]

    def holder(self, inst: int) -> str:
        return self._pool.holders[inst]

    def slots(self) -> Collection[int]:
        return list(self._pool.slots)

    def add_slot(self, inst: int) -> None:
        self._pool.slots[inst] = self._new_slot(inst)

    def spawn(
        self, inst: int, incarnation: int, rewards: Mapping[str, Handle], at_least: int
    ) -> RayPending[int]:
        actor = spawn_instance(
            self._ctx, self._pool, inst, incarnation, self._ps, self._control, rewards, at_least
        )
        return RayPending(self._ctx.ray, actor.version.remote())

    def set_rewards(self, inst: int, rewards: Mapping[str, Handle]) -> None:
        self._pool.actors[inst].set_rewards.remote(dict(rewards))

    def stop(self, inst: int, timeout_s: float) -> None:
        self._ctx.ray.get(self._pool.actors[inst].stop.remote(), timeout=timeout_s)

    def kill(self, inst: int) -> None:
        _kill(self._ctx.ray, self._pool.actors.get(inst))

    def release_slots(self) -> None:
        for slot in self._pool.slots.values():
            try:
                release_slot(slot)
            except Exception as exc:  # the run is ending; the cluster reclaims it
                logger.debug("placement group of %s: %s", slot.role, exc)


class RayRewardWorkers:
    """The reward pool (``RewardPool``)."""

    def __init__(self, ctx: PoolContext, pool: RewardPool, control: ControlPool) -> None:
        self._ctx, self._pool, self._control = ctx, pool, control

    def live(self) -> Mapping[str, Handle]:
        return self._pool.live()

    def role_of(self, wid: str) -> str:
        return self._pool.role_of[wid]

    def ping(self, wid: str) -> RayPending[object]:
        return RayPending(self._ctx.ray, self._pool.workers[wid].ping.remote())

    def spawn(self, role: str, incarnation: int) -> str:
        return spawn_worker(self._ctx, self._pool, role, incarnation, self._control)

    def remove(self, wid: str) -> None:
        _kill(self._ctx.ray, self._pool.workers.pop(wid))

    def score(self, wid: str, tasks: Sequence[RewardTask]) -> RayPending[None]:
        return RayPending(self._ctx.ray, self._pool.workers[wid].process_tasks.remote(list(tasks)))


class RayParameterServers:
    """The PS pool (``PSPool``): a restarted replica replaces its actor there."""

    def __init__(self, ctx: PoolContext, pool: PSPool) -> None:
        self._ctx, self._pool = ctx, pool

    def handles(self) -> Mapping[str, Handle]:
        return dict(self._pool.actors)

    def alive(self, role: str) -> RayPending[bool]:
        return RayPending(self._ctx.ray, self._pool.actors[role].alive.remote())

    def stop(self, role: str, timeout_s: float) -> None:
        self._ctx.ray.get(self._pool.actors[role].stop.remote(), timeout=timeout_s)

    def kill(self, role: str) -> None:
        _kill(self._ctx.ray, self._pool.actors.get(role))

    def respawn(self, role: str) -> None:
        respawn_replica(self._ctx, self._pool, role)


class RayTrainer:
    def __init__(self, pool: TrainerPool) -> None:
        self._pool = pool

    def handles(self) -> Mapping[str, Handle]:
        return self._pool.handles()

    def refill_ps(self) -> None:
        self._pool.refill_ps()


class RunFolderLive:
    """``RUN_DIR/live.json`` through the run folder's layout; each actor's pid asked."""

    def __init__(self, ray: ModuleType, run_dir: Path) -> None:
        self._ray, self._run_dir = ray, run_dir

    def write(self, actors: Mapping[str, Handle]) -> None:
        pids = {}
        for role, actor in actors.items():
            try:
                pids[role] = self._ray.get(actor.pid.remote(), timeout=30)  # type: ignore[attr-defined]
            except Exception as exc:  # dying: its successor is written next time
                logger.debug("no pid for %s: %s", role, exc)
        info = {
            "run": self._run_dir.name,
            "ray_address": _gcs_address(self._ray),
            "driver_pid": os.getpid(),
            "pids": pids,
        }
        RunLayout(self._run_dir).write_live(info)

    def remove(self) -> None:
        RunLayout(self._run_dir).remove_live()


def _gcs_address(ray: ModuleType) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return ""


def supervised_pools(
    ctx: PoolContext,
    control: ControlPool,
    ps: PSPool,
    rewards: RewardPool,
    rollout: RolloutPool,
    trainer: TrainerPool,
    *,
    run_dir: Path,
    new_slot: Callable[[int], Slot],
    phase: Callable[[str], None],
    resume_hint: Callable[[], str],
) -> Supervised:
    """The faces of a started run's pools, for its supervisor. ``new_slot(inst)`` places
    an instance added to the running run (``pools.rollout.new_slot``)."""
    return Supervised(
        rollout=RayRolloutFleet(ctx, rollout, ps, control, new_slot),
        rewards=RayRewardWorkers(ctx, rewards, control),
        ps=RayParameterServers(ctx, ps),
        trainer=RayTrainer(trainer),
        control=control.supervisor,  # the control actor's typed client
        ts=control.ts,
        live=RunFolderLive(ctx.ray, run_dir),
        phase=phase,
        resume_hint=resume_hint,
    )
