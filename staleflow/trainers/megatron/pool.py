"""``trainer.backend=megatron``: the trainer as a Ray actor pool of Megatron-core ranks.

:class:`MegatronTrainer` lives where the training loop runs and drives ``dp x tp x pp``
:class:`RankActor` processes (each reserving ``trainer.gpus_per_rank`` GPUs). It is the
loop's :class:`~staleflow.runtime.training.StepDriver`:

- ``train_consumed``: the consumed groups are split over the data-parallel ranks
  (:func:`~staleflow.trainers.megatron.split.assign_groups`); each replica's data leader
  takes its groups from the trajectory server itself, so payloads never pass through the
  driver or another replica; all ranks step together and rank 0 returns the metrics.
- ``publish``: each rank started Pushing its own shards at the end of its step; the
  handle waits until every rank's Push of that version is done.

Ray and megatron-core are imported inside the rank processes only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staleflow.trainers.megatron.split import assign_groups

logger = logging.getLogger(__name__)

MEGATRON_DIR = "megatron"  # the distributed checkpoint inside a checkpoint folder


class RankActor:
    """The body of one rank's Ray actor (made remote by :class:`MegatronTrainer`)."""

    def __init__(self, spec: Any, rank: int) -> None:
        import os

        os.environ.setdefault("OMP_NUM_THREADS", str(spec.section.num_threads))
        import torch

        torch.set_num_threads(spec.section.num_threads)
        self._spec, self._rank_id = spec, rank
        self._rank: Any = None
        self._ts: Any = None

    def rendezvous(self) -> str:
        """``host:port`` where rank 0 waits for the others."""
        from staleflow.trainers.megatron.rank import free_port, host_address

        return f"{host_address()}:{free_port()}"

    def start(self, address: str, ps_endpoint: Any, ts_handle: Any, load: str) -> int:
        """Join the group, build the model, load the weights (the PS's latest version, or
        the distributed checkpoint ``load``), connect the sharded Push; returns the
        version of the weights."""
        from staleflow.trainers.megatron.rank import MegatronRank, init_distributed

        init_distributed(self._rank_id, self._spec.world, address)
        rank = MegatronRank(self._spec)
        if load:
            from staleflow.trainers.megatron.checkpoint import load_checkpoint

            # weights and optimizer state from the checkpoint; the run's versions are the
            # PS's (its version 0 is the HF folder written beside the checkpoint)
            load_checkpoint(rank, load)
            rank.version = self._ps_version(ps_endpoint) if ps_endpoint is not None else 0
        else:
            rank.version = self._load_from_ps(rank, ps_endpoint)
        if ps_endpoint is not None:
            rank.attach_push(ps_endpoint)
        if ts_handle is not None and rank.is_data_leader:
            from trajectory_server.actor import TrajectoryServerClient

            self._ts = TrajectoryServerClient(ts_handle)
        self._rank = rank
        return rank.version

    def _load_from_ps(self, rank: Any, endpoint: Any) -> int:
        import numpy as np

        from parameter_server.transport import connect

        with connect(endpoint, "auto") as transport:
            buffer = np.empty(transport.layout.nbytes, dtype=np.uint8)
            version = transport.pull(buffer)
            rank.load_hf(transport.layout.views(buffer))
        return version

    @staticmethod
    def _ps_version(endpoint: Any) -> int:
        from parameter_server.transport import connect

        with connect(endpoint, "auto") as transport:
            return int(transport.info().latest or 0)

    def step(self, select: Mapping[int, Sequence[int]] | None) -> tuple[dict[str, float], Any]:
        """One training step; a data leader takes its ``select``ed groups from the TS.
        Returns the metrics and (data leaders) the digest of the part it trained."""
        from staleflow.runtime.training import BatchDigest
        from trajectory_server.types import TrainingBatch

        rank = self._rank
        part = digest = None
        if rank.is_data_leader:
            select = select or {}
            part = self._ts.take_batch(list(select), select) if select else TrainingBatch(())
            digest = BatchDigest.of(part, rank.version)
        metrics = rank.train_step(part)
        rank.start_push()
        return metrics, digest

    def wait_push(self, version: int) -> None:
        """Return once this rank's Push of ``version`` is done (at once if it was fenced)."""
        if self._rank.version == version:
            self._rank.wait_push()

    def save_checkpoint(self, path: str) -> None:
        from staleflow.trainers.megatron.checkpoint import export_hf, save_checkpoint

        rank = self._rank
        save_checkpoint(rank, str(Path(path) / MEGATRON_DIR))
        weights = rank.gather_hf()
        if weights is not None:
            spec = self._spec
            export_hf(
                weights,
                spec.hf_config,
                path,
                dtype=spec.dtype,
                save_tokenizer=_tokenizer_saver(spec.tokenizer),
            )

    def close(self) -> None:
        if self._rank is not None:
            self._rank.close()


def _tokenizer_saver(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    from staleflow.models.checkpoint import save_tokenizer

    return lambda out: save_tokenizer(tokenizer, out)


def _packed(world: int, gpus: int) -> Any:
    """A placement group of one GPU bundle per rank, packed onto as few nodes as Ray can:
    ranks are numbered TP-first, so a TP group shares a node (and NVLink) when it fits."""
    import ray

    group = ray.util.placement_group([{"GPU": gpus, "CPU": 1}] * world, strategy="PACK")
    ray.get(group.ready())
    return group


@dataclass
class _PoolPush:
    """The publish handle of the pool: every rank's Push of ``version``."""

    ranks: list[Any]
    version: int

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ray.get([r.wait_push.remote(self.version) for r in self.ranks], timeout=timeout)
        return self.version


class MegatronTrainer:
    """The pool; see the module docstring. ``spec`` is a
    :class:`~staleflow.trainers.megatron.rank.RankSpec`; ``names`` prefixes the actors'
    Ray names (``<prefix>trainer/rank<g>``)."""

    def __init__(
        self,
        spec: Any,
        *,
        ps_endpoint: Any,
        ts_handle: Any,
        name_prefix: str = "",
        namespace: str | None = None,
    ) -> None:
        import ray

        s = spec.section
        self.spec = spec
        actor = ray.remote(RankActor)
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": s.gpus_per_rank}
        if namespace is not None:
            options["namespace"] = namespace
        group = _packed(spec.world, s.gpus_per_rank) if s.gpus_per_rank else None
        self.ranks = []
        for g in range(spec.world):
            extra: dict[str, Any] = {"name": f"{name_prefix}trainer/rank{g}"} if name_prefix else {}
            if group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                extra["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=g
                )
            self.ranks.append(actor.options(**extra, **options).remote(spec, g))
        address = ray.get(self.ranks[0].rendezvous.remote())
        versions = ray.get(
            [r.start.remote(address, ps_endpoint, ts_handle, s.load) for r in self.ranks]
        )
        if len(set(versions)) != 1:
            raise RuntimeError(f"the ranks loaded different versions {versions}")
        self._version = int(versions[0])
        # global rank g is TP rank g % tp of replica g // tp (Megatron's tp-first order)
        self._leaders = {g // s.tp: g for g in range(spec.world) if g % s.tp == 0}

    @property
    def version(self) -> int:
        return self._version

    def train_consumed(self, select: Mapping[int, Sequence[int]]) -> Any:
        import ray

        from staleflow.runtime.training import BatchDigest, TrainedStep

        parts = assign_groups({g: len(ids) for g, ids in select.items()}, self.spec.section.dp)
        calls = []
        for g, rank in enumerate(self.ranks):
            replica = g // self.spec.section.tp
            mine = None
            if self._leaders.get(replica) == g:
                mine = {gid: tuple(select[gid]) for gid in parts[replica]}
            calls.append(rank.step.remote(mine))
        results = ray.get(calls)
        self._version += 1
        metrics = results[0][0]
        digest = BatchDigest.merge(d for _, d in results if d is not None)
        return TrainedStep(metrics, digest)

    def publish(self, version: int) -> _PoolPush:
        if version != self._version:
            raise ValueError(f"the pool holds version {self._version}, not {version}")
        return _PoolPush(self.ranks, version)

    def save_checkpoint(self, path: str | Path) -> None:
        """A distributed checkpoint in ``path/megatron`` (loadable at any TP with
        ``trainer.load``) and the HF folder at ``path`` (``model.checkpoint=<path>``)."""
        import ray

        ray.get([r.save_checkpoint.remote(str(path)) for r in self.ranks])

    def close(self) -> None:
        import ray

        for r in self.ranks:
            try:
                ray.get(r.close.remote(), timeout=60)
            finally:
                ray.kill(r)
