"""``trainer.backend=megatron``: the trainer as a Ray actor pool of Megatron-core ranks.

:class:`RankActor` is the body of one rank's actor; the launcher's pool builder
(:func:`staleflow.runtime.driver.pools.megatron.build_megatron_pool`) starts ``dp x tp x pp`` of
them in the trainer gang's placement-group bundles and :func:`start_ranks` joins them in
one process group. :class:`MegatronTrainer` is the training loop's
:class:`~staleflow.runtime.workers.training_loop.StepDriver` over the started ranks (plain data: rank
handles and ids, so it travels to the loop's actor):

- ``train_consumed``: the consumed groups are split over the data-parallel ranks
  (:func:`~staleflow.trainers.megatron.split.assign_groups`); each replica's data leader
  takes its groups from the trajectory server itself, so payloads never pass through the
  driver or another replica; all ranks step together and rank 0 returns the metrics.
- ``publish``: each rank started Pushing its own shards to every PS replica at the end of
  its step; the handle waits until every rank's Push of that version is done.

Ray and megatron-core are imported inside the rank processes only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parameter_server.replicas import ReplicaVersions, replica_group
from staleflow.models.checkpoint import save_tokenizer
from staleflow.recovery.checkpoint import MEGATRON_DIR
from staleflow.trainers.interface import BatchDigest, StreamedGroups, TrainedStep
from staleflow.trainers.megatron.checkpoint import export_hf, load_checkpoint, save_checkpoint
from staleflow.trainers.megatron.rank import MegatronRank, free_port, host_address, init_distributed
from staleflow.trainers.megatron.split import assign_groups, coordinates
from staleflow.trainers.rng import rng_state, set_rng_state
from trajectory_server.actor import TrajectoryServerClient
from trajectory_server.types import TrainingBatch

if TYPE_CHECKING:
    from types import ModuleType

    from ray.actor import ActorHandle

    from parameter_server.replicas import ReplicaRoute
    from staleflow.data.tokenizer import Tokenizer
    from staleflow.trainers.megatron.rank import RankSpec

logger = logging.getLogger(__name__)

RNG_DIR = "rng"  # each rank's torch RNG state inside a checkpoint folder: rank-<g>.pt


class RankActor:
    """The body of one rank's Ray actor (made remote by the pool builder)."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        import torch

        torch.set_num_threads(spec.section.num_threads)
        self._spec, self._rank_id = spec, rank
        self._rank: MegatronRank | None = None
        self._ts: TrajectoryServerClient | None = None
        self._read = StreamedGroups()  # a data leader's streamed groups until the Consume

    def rendezvous(self) -> str:
        """``host:port`` where rank 0 waits for the others."""

        return f"{host_address()}:{free_port()}"

    def start(
        self,
        address: str,
        routes: Mapping[int, Sequence[ReplicaRoute]],
        ts_handle: ActorHandle | None,
        load: str,
    ) -> int:
        """Join the group, build the model, load the weights (version 0 from the PS, or the
        distributed checkpoint ``load``), connect the sharded Push to every PS replica
        (``routes``: every rank's routes to them); returns the version of the weights."""

        init_distributed(self._rank_id, self._spec.world, address)
        rank = MegatronRank(self._spec)
        mine = routes[self._rank_id]
        if load:
            # weights and optimizer state from the checkpoint; the run's versions are the
            # PS's (its version 0 is the HF folder written beside the checkpoint)
            load_checkpoint(rank, load)
            self._load_rng(Path(load).parent / RNG_DIR)
            rank.version = _ps_version(mine)
        else:
            rank.version = self._load_from_ps(rank, mine)
        rank.attach_push(routes)
        if ts_handle is not None and rank.is_data_leader:
            self._ts = TrajectoryServerClient(ts_handle)
        self._rank = rank
        return rank.version

    def _load_rng(self, folder: Path) -> None:
        """This rank's RNG state, where the checkpoint has it (a step seeds its own from
        the seed and the version; this keeps whatever else draws on torch's generators
        where it was)."""
        import torch

        file = folder / f"rank-{self._rank_id}.pt"
        if file.is_file():
            set_rng_state(torch.load(file, weights_only=True))

    def _load_from_ps(self, rank: MegatronRank, routes: Sequence[ReplicaRoute]) -> int:
        """The newest version all replicas hold, pulled from the nearest ones."""
        import numpy as np

        with replica_group(routes, receiver=f"rank{self._rank_id}") as group:
            buffer = np.empty(group.layout.nbytes, dtype=np.uint8)
            version = group.pull(buffer)
            rank.load_hf(group.layout.views(buffer))
        return version

    def push_routes(self) -> dict[str, tuple[str, int]]:
        """Per PS replica: the transport of this rank's Push and its bytes per version
        (the pieces travel over the replica's socket)."""
        return {replica: ("socket", n) for replica, n in self._rank.push_bytes().items()}

    def refill_ps(self, resolve: Callable[[str], Any]) -> list[str]:
        """PS replicas were restarted: Push this rank's pieces of the current version to
        each replica ``resolve`` (replica -> the endpoint it serves now) shows moved."""
        rank = self._rank
        return rank.refill_push({name: resolve(name) for name in rank.push_replicas()})

    def step(
        self, select: Mapping[int, Sequence[int]] | None, streamed: Collection[int] = ()
    ) -> tuple[dict[str, float], Any]:
        """One training step; a data leader takes its ``select``ed groups from the TS and
        trains those not ``streamed`` already. Returns the metrics and (data leaders) the
        digest of the part it took."""

        rank = self._rank
        part = digest = None
        if rank.is_data_leader:
            whole = part = TrainingBatch(())
            if select:
                whole, part = self._read.take(self._ts, select, streamed)
            self._read.clear()  # a leader with no group this step may still hold reads
            digest = BatchDigest.of(whole, rank.version)
        metrics = rank.train_step(part)
        rank.start_push()
        return metrics, digest

    def stream(self, select: Mapping[int, Sequence[int]] | None) -> None:
        """Forward/backward on groups of the next step (``trainer.stream``): a data leader
        reads its ``select``ed groups from the TS, which keeps them until the Consume."""

        part = None
        if self._rank.is_data_leader:
            part = self._read.read(self._ts, select) if select else TrainingBatch(())
        self._rank.stream(part)

    def drop_stream(self) -> None:
        self._rank.drop_stream()
        self._read.clear()

    def wait_push(self, version: int) -> None:
        """Return once this rank's Push of ``version`` is done (at once if it was fenced)."""
        if self._rank.version == version:
            self._rank.wait_push()

    def save_checkpoint(self, path: str) -> None:
        import torch

        rank = self._rank
        save_checkpoint(rank, str(Path(path) / MEGATRON_DIR))
        rng = Path(path) / RNG_DIR
        rng.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), rng / f"rank-{self._rank_id}.pt")
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
        """Finish the Push in flight and leave the process group (the actor is killed
        next; a group left to interpreter teardown can abort the process)."""
        import torch.distributed as dist

        try:
            if self._rank is not None:
                self._rank.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _ps_version(routes: Sequence[ReplicaRoute]) -> int:

    versions = ReplicaVersions({r.replica: r.endpoint for r in routes}, client="rank")
    try:
        return int(versions.latest() or 0)
    finally:
        versions.close()


def start_ranks(
    ray: ModuleType,  # the ray module, imported by the caller
    ranks: Sequence[ActorHandle],
    routes: Mapping[int, Sequence[ReplicaRoute]],
    ts_handle: ActorHandle | None,
    load: str,
) -> int:
    """Join the started :class:`RankActor` handles ``ranks`` (global rank order) in one
    process group and load their weights; returns the version they start from."""
    address = ray.get(ranks[0].rendezvous.remote())
    versions = ray.get([r.start.remote(address, routes, ts_handle, load) for r in ranks])
    if len(set(versions)) != 1:
        raise RuntimeError(f"the ranks loaded different versions {versions}")
    return int(versions[0])


def _tokenizer_saver(tokenizer: Tokenizer | None) -> Callable[[Path], None] | None:
    if tokenizer is None:
        return None

    return lambda out: save_tokenizer(tokenizer, out)


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
    """The pool as the training loop drives it; see the module docstring. ``spec`` is a
    :class:`~staleflow.trainers.megatron.rank.RankSpec`, ``ranks`` the started rank actors
    in global rank order, ``version`` the one they start from (:func:`start_ranks`)."""

    def __init__(self, spec: RankSpec, ranks: Sequence[Any], version: int) -> None:
        s = spec.section
        if len(ranks) != spec.world:
            raise ValueError(f"{len(ranks)} rank actors for dp x tp x pp = {spec.world}")
        self.spec = spec
        self.ranks = list(ranks)
        self._version = int(version)
        self._streamed_by: dict[int, int] = {}  # group -> the data leader that streamed it
        # a step, a checkpoint and a refill each call every rank: two of them interleaved
        # could meet different ranks in different orders, and their collectives deadlock
        self._lock = threading.Lock()
        # each replica's data leader: TP rank 0 of its first pipeline stage
        self._leaders = {
            coordinates(g, s.tp, s.dp)[1]: g
            for g in range(spec.world)
            if coordinates(g, s.tp, s.dp)[::2] == (0, 0)
        }

    def __getstate__(self) -> dict[str, Any]:  # the driver travels to the loop's actor
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    def train_consumed(
        self, select: Mapping[int, Sequence[int]], streamed: Collection[int] = ()
    ) -> Any:
        import ray

        # the groups still to train are shared out evenly; each streamed one only leaves
        # the TS, with the data leader that read it (which has its payload already)
        streamed = set(streamed)
        rest = {g: ids for g, ids in select.items() if g not in streamed}
        done = {g: ids for g, ids in select.items() if g in streamed}
        with self._lock:
            shares = self._shares(rest, done, self._streamed_by)
            calls = [
                rank.step.remote(mine, tuple(done))
                for rank, mine in zip(self.ranks, shares, strict=True)
            ]
            results = ray.get(calls)
            self._version += 1
            self._streamed_by.clear()
        metrics = results[0][0]
        digest = BatchDigest.merge(d for _, d in results if d is not None)
        return TrainedStep(metrics, digest)

    @property
    def streams(self) -> bool:
        return True

    def stream(self, select: Mapping[int, Sequence[int]]) -> None:
        """Every rank trains its replica's share of these groups of the next step."""
        import ray

        with self._lock:
            shares = self._shares(select)
            calls = zip(self.ranks, shares, strict=True)
            ray.get([rank.stream.remote(mine) for rank, mine in calls])
            for g, mine in enumerate(shares):
                self._streamed_by.update((gid, g) for gid in mine or ())

    def drop_stream(self) -> None:
        import ray

        with self._lock:
            ray.get([r.drop_stream.remote() for r in self.ranks])
            self._streamed_by.clear()

    def _shares(
        self,
        select: Mapping[int, Sequence[int]],
        extra: Mapping[int, Sequence[int]] | None = None,
        owners: Mapping[int, int] | None = None,
    ) -> list[dict[int, tuple[int, ...]] | None]:
        """Per global rank: its replica's groups of ``select`` (balanced, whole groups) if it
        is the replica's data leader, else None. A group of ``extra`` goes to the leader
        ``owners`` names for it (global rank), else to replica 0's."""
        s = self.spec.section
        parts = assign_groups({g: len(ids) for g, ids in select.items()}, s.dp)
        out: list[dict[int, tuple[int, ...]] | None] = []
        for g in range(len(self.ranks)):
            replica = coordinates(g, s.tp, s.dp)[1]
            mine = None
            if self._leaders.get(replica) == g:
                mine = {gid: tuple(select[gid]) for gid in parts[replica]}
            out.append(mine)
        for gid, ids in (extra or {}).items():
            owner = (owners or {}).get(gid, self._leaders[0])
            out[owner] = {**(out[owner] or {}), gid: tuple(ids)}
        return out

    def publish(self, version: int) -> _PoolPush:
        if version != self._version:
            raise ValueError(f"the pool holds version {self._version}, not {version}")
        return _PoolPush(self.ranks, version)

    def save_checkpoint(self, path: str | Path) -> None:
        """A distributed checkpoint in ``path/megatron`` (loadable at any TP with
        ``trainer.load``), each rank's RNG state in ``path/rng`` and the HF folder at
        ``path`` (``model.checkpoint=<path>``)."""
        import ray

        with self._lock:
            ray.get([r.save_checkpoint.remote(str(path)) for r in self.ranks])

    def refill_ps(self, resolve: Callable[[str], Any]) -> int:
        """PS replicas were restarted empty: every rank connects to them and Pushes its
        pieces of the current version, between two steps; ``resolve`` gives the endpoint
        a replica serves now. Returns how many replicas were refilled."""
        import ray

        with self._lock:
            moved = ray.get([r.refill_ps.remote(resolve) for r in self.ranks])
        if any(m != moved[0] for m in moved):
            raise RuntimeError(f"the ranks refilled different PS replicas: {moved}")
        return len(moved[0])

    def close(self) -> None:
        """Finish every rank's Push in flight and disconnect it from the PS (the pool's
        owner kills the actors)."""
        import ray

        ray.get([r.close.remote() for r in self.ranks], timeout=60)
