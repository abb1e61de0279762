"""The trainer pool, chosen by ``trainer.backend``
(:data:`staleflow.runtime.backends.TRAINER_POOLS`). The embedded one is a single rank
that Pushes each version to every PS replica; the Megatron one is in
:mod:`staleflow.runtime.driver.pools.megatron`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from staleflow.runtime.backends import load_hook, trainer_backend
from staleflow.runtime.driver.pools import PoolContext
from staleflow.runtime.driver.pools.controller import ControlPool
from staleflow.runtime.driver.pools.parameter_server import PSPool
from staleflow.runtime.workers.actors import InstanceRecovery, TrainerActor, process_env
from staleflow.runtime.workers.specs import TrainerSpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from staleflow.runtime.placement.ray_cluster import RayApi


class TrainerPool(Protocol):
    """What the launcher asks of a trainer pool, whatever its backend and rank count."""

    def handles(self) -> dict[str, Any]:
        """Ray actor of every rank, by role (``trainer/<r>``)."""
        ...

    def run(self, steps: int) -> Any:
        """Start ``steps`` training steps; an ObjectRef of the list of StepReports."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Write the trainer's part of a run checkpoint into ``path`` (which it creates):
        weights, optimizer, RNG and version; a pool of ranks returns once every rank
        wrote its shard. Called while ``run`` waits for a buffer (docs/recovery.md)."""
        ...

    def version(self) -> int:
        """The trainer's version (after a resume: the checkpoint's)."""
        ...

    def refill_ps(self) -> None:
        """Push the newest weights to PS replicas that were restarted empty."""
        ...

    def push_transports(self) -> dict[str, dict[str, str]]:
        """Per rank, the transport each PS replica's Push takes."""
        ...

    def push_bytes(self) -> dict[str, dict[str, int]] | None:
        """Per rank, the bytes each PS replica gets from it per version, for a pool that
        plans its own Push (ranks holding shards); None when every rank holds the whole
        model and the launcher's Push plan (App. A.2) says who sends what."""
        ...

    def stop(self) -> None: ...


class EmbeddedTrainerPool:
    def __init__(self, ray: RayApi, role: str, actor: ActorHandle) -> None:
        self._ray, self._role, self._actor = ray, role, actor

    def handles(self) -> dict[str, Any]:
        return {self._role: self._actor}

    def run(self, steps: int) -> Any:
        return self._actor.run.remote(steps)

    def save_checkpoint(self, path: str) -> None:
        self._ray.get(self._actor.save_checkpoint.remote(path))

    def push_transports(self) -> dict[str, dict[str, str]]:
        return {self._role: self._ray.get(self._actor.push_transports.remote())}

    def version(self) -> int:
        return int(self._ray.get(self._actor.version.remote()))

    def refill_ps(self) -> None:
        self._ray.get(self._actor.refill_ps.remote())

    def push_bytes(self) -> None:
        return None

    def stop(self) -> None:
        self._ray.get(self._actor.stop.remote(), timeout=30)


def build_embedded_pool(
    ctx: PoolContext,
    spec: TrainerSpec,
    ps: PSPool,
    control: ControlPool,
    recovery: InstanceRecovery | None = None,
) -> EmbeddedTrainerPool:
    placed = ctx.placement.gang("trainer")
    (role,) = placed.gang.roles
    env = process_env(spec.trainer.num_threads, quiet_downloads=True)
    # two threads: run() holds one; save_checkpoint / refill_ps come on the other
    actor = ctx.spawn(TrainerActor, role, env, max_concurrency=2).remote(
        spec,
        ps.routes(placed.nodes[0]),
        control.ts.handle,
        control.control,
        role,
        recovery,
        spec.resume_from,
    )
    return EmbeddedTrainerPool(ctx.ray, role, actor)


def build_trainer(
    ctx: PoolContext,
    spec: TrainerSpec,
    ps: PSPool,
    control: ControlPool,
    recovery: InstanceRecovery | None = None,
) -> TrainerPool:
    """The pool of ``spec.trainer.backend``, built by its registered hook."""
    build = load_hook(trainer_backend(spec.trainer.backend).pool)
    return build(ctx, spec, ps, control, recovery)
