"""The Megatron trainer pool (``trainer.backend=megatron``): ``dp x tp x pp`` rank actors,
one in each bundle of the trainer gang's placement group (``trainer/<g>``, global rank
``g``), and the training loop's actor (``trainer/loop``, no resources of its own, beside
rank 0).

Every rank Pulls version 0 from the nearest PS replica, and after each step Pushes its
own pieces to **every** replica (App. A.1): each replica gathers a version from all ranks
and publishes it whole (:mod:`parameter_server.shard_push`, :mod:`parameter_server.assemble`).
The ranks' routes to the replicas come from where the placement put each rank, and all
ranks plan the pieces from all of them (the same plan on every rank).

A run checkpoint's ``trainer/`` part is the pool's :meth:`MegatronTrainer.save_checkpoint`:
the HF folder (what a resumed run's PS and rollout engines start from), the distributed
checkpoint in ``trainer/megatron`` (weights, optimizer, version) and each rank's torch
RNG state; a resumed pool loads them instead of ``trainer.load`` (docs/recovery.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from parameter_server import Layout
from staleflow.runtime.driver.pools import PoolContext
from staleflow.runtime.driver.pools.controller import ControlPool
from staleflow.runtime.driver.pools.parameter_server import PSPool
from staleflow.runtime.errors import LaunchError
from staleflow.runtime.workers.actors import InstanceRecovery, PoolTrainerActor, process_env
from staleflow.runtime.workers.specs import TrainerSpec, tokenizer_from_spec
from staleflow.trainers.megatron.pool import MEGATRON_DIR, MegatronTrainer, RankActor, start_ranks
from staleflow.trainers.megatron.rank import RankSpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from staleflow.runtime.placement.ray_cluster import RayApi
    from staleflow.runtime.workers.ps_healing import ReplicaResolver

LOOP_ROLE = "trainer/loop"


class MegatronPool:
    """The launcher's view of the pool (:class:`~staleflow.runtime.driver.pools.trainer.TrainerPool`)."""

    def __init__(
        self,
        ray: RayApi,
        loop: ActorHandle,
        ranks: dict[str, Any],
        resolver: ReplicaResolver | None = None,
    ) -> None:
        self._ray, self._loop, self._ranks = ray, loop, ranks
        self._resolver = resolver

    def handles(self) -> dict[str, Any]:
        return {LOOP_ROLE: self._loop, **self._ranks}

    def run(self, steps: int) -> Any:
        return self._loop.run.remote(steps)

    def save_checkpoint(self, path: str) -> None:
        self._ray.get(self._loop.save_checkpoint.remote(path))

    def version(self) -> int:
        return int(self._ray.get(self._loop.version.remote()))

    def refill_ps(self) -> None:
        """A PS replica was restarted empty: every rank connects to it and Pushes its
        pieces of the current version, between two steps (the ranks left it out of their
        Pushes since they lost it)."""
        if self._resolver is None:
            raise LaunchError(
                "a PS replica was restarted, and this Megatron trainer pool was built without "
                "a way to find it (no recovery settings)"
            )
        self._ray.get(self._loop.refill_ps.remote(self._resolver))

    def _push_routes(self) -> dict[str, dict[str, tuple[str, int]]]:
        routes = self._ray.get([r.push_routes.remote() for r in self._ranks.values()])
        return dict(zip(self._ranks, routes, strict=True))

    def push_transports(self) -> dict[str, dict[str, str]]:
        return {
            role: {replica: transport for replica, (transport, _) in routes.items()}
            for role, routes in self._push_routes().items()
        }

    def push_bytes(self) -> dict[str, dict[str, int]] | None:
        return {
            role: {replica: n for replica, (_, n) in routes.items()}
            for role, routes in self._push_routes().items()
        }

    def stop(self) -> None:
        self._ray.get(self._loop.stop.remote(), timeout=90)


def build_megatron_pool(
    ctx: PoolContext,
    spec: TrainerSpec,
    ps: PSPool,
    control: ControlPool,
    recovery: InstanceRecovery | None = None,
) -> MegatronPool:
    """The ranks and the loop; ``recovery`` finds a restarted PS replica for
    :meth:`MegatronPool.refill_ps`. A resumed run (``spec.resume_from``) loads the run
    checkpoint's distributed checkpoint, at the version the PS was started with."""

    placed = ctx.placement.gang("trainer")
    roles = placed.gang.roles
    dtypes = {p.dtype for p in Layout.from_dict(spec.layout)}
    rank_spec = RankSpec(
        hf_config=spec.model.hf_config,
        section=spec.trainer,
        pad_id=spec.model.pad_token_id,
        seed=spec.seed,
        dtype=dtypes.pop() if len(dtypes) == 1 else "float32",
        tokenizer=tokenizer_from_spec(spec.model.tokenizer),
    )
    if len(roles) != rank_spec.world:
        raise ValueError(f"the trainer gang has {len(roles)} bundles for {rank_spec.world} ranks")
    env = process_env(spec.trainer.num_threads, quiet_downloads=True)
    ranks = {
        role: ctx.spawn(RankActor, role, env).remote(rank_spec, g) for g, role in enumerate(roles)
    }
    routes = {g: ps.routes(placed.node_of(role)) for g, role in enumerate(roles)}
    load = str(Path(spec.resume_from) / MEGATRON_DIR) if spec.resume_from else spec.trainer.load
    version = start_ranks(ctx.ray, list(ranks.values()), routes, control.ts.handle, load)
    driver = MegatronTrainer(rank_spec, list(ranks.values()), version)
    # the loop only moves group ids and metrics: it rides in rank 0's bundle, asking nothing
    options = {
        **ctx.options(roles[0], process_env(1)),
        **ctx.naming(LOOP_ROLE),
        "num_cpus": 0,
        "num_gpus": 0,
        "resources": {},
        # two threads: run() holds one while it waits for a buffer; the driver's
        # save_checkpoint for a checkpoint cut comes on the other
        "max_concurrency": 2,
    }
    loop = ctx.ray.remote(PoolTrainerActor).options(**options).remote(spec, driver, control.control)
    return MegatronPool(ctx.ray, loop, ranks, recovery.resolver if recovery else None)
