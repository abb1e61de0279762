"""One Megatron-core training rank: a process of the trainer pool.

A rank joins the pool's torch.distributed group (gloo on CPU, NCCL on GPU) and Megatron's
parallel state (TP x DP x PP; ranks are numbered TP-fastest, pipeline stages slowest:
Megatron's ``tp-cp-ep-dp-pp`` order, :func:`~staleflow.trainers.megatron.split.coordinates`),
builds its shard of its pipeline stage's layers from the policy's HF config, loads its
shard of the HF weights through :class:`~parameter_server.convert_megatron.MegatronToHF`,
and trains with the step shared with the embedded trainer
(:func:`staleflow.trainers.rl.train_step`; with PP > 1 its micro-batches go through
Megatron's 1F1B schedule and the last stage computes the loss).

Data: the first rank of each data-parallel replica (TP rank 0 of its first stage)
receives the replica's groups straight from the trajectory server and broadcasts them to
its TP and PP peers, so no rank ever holds another replica's trajectories.

Reference policy (``trainer.kl_coef > 0``, ``trainer.ref``): each rank holds its own
shard of a frozen second model, built like the policy's stage and loaded at the first
step (:meth:`MegatronRank.init_reference`): a copy of the policy's weights then (the
initial policy) or the shard of the ``trainer.ref.path`` model folder. A distributed
checkpoint holds it (:mod:`staleflow.trainers.megatron.checkpoint`), so a resumed run (or
``trainer.load``) keeps the KL to the run's reference, not to the weights it resumes
from. It scores each batch in one forward-only pass through the same backend code (and,
with PP > 1, the same 1F1B schedule), so the reference costs each rank its shard of the
weights and that pass.

Push: after each step every rank sends its own pieces of the new weights to every PS
replica (:class:`~parameter_server.shard_push.ShardPushGroup`) in the background, reading the
live parameters while the next step's forward and backward passes run; the next update
waits for it first (:mod:`staleflow.trainers.megatron.optim`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from parameter_server.convert_megatron import MegatronToHF, gpt_config_from_hf
from parameter_server.push import BackgroundPusher
from parameter_server.replicas import ReplicaRoute
from parameter_server.shard_push import ShardPushGroup
from parameter_server.torch_compat import to_numpy
from parameter_server.transport.base import Endpoint
from staleflow.config.sections import TrainerConfig
from staleflow.trainers.megatron.backend import VocabParallelBackend
from staleflow.trainers.megatron.cpu_patches import apply_cpu_patches, cpu_devices
from staleflow.trainers.megatron.model import Stage, build_gpt, load_shard, parameters_by_name
from staleflow.trainers.megatron.optim import CpuUpdate, MegatronUpdate
from staleflow.trainers.megatron.split import coordinates
from staleflow.trainers.reference import reference_weights
from staleflow.trainers.rl import train_step
from staleflow.trainers.streamed import StreamedStep
from trajectory_server.types import TrainingBatch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from staleflow.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank of a pool is built from (plain data: it travels to Ray actors)."""

    hf_config: dict[str, Any]  # the policy's config.json
    section: TrainerConfig = field(default_factory=TrainerConfig)
    pad_id: int = 0
    seed: int = 0
    dtype: str = "float32"  # of the weights the PS serves (and the rank trains, on CPU)
    tokenizer: Tokenizer | None = None  # saved into HF exports, so that they load as a policy

    @property
    def world(self) -> int:
        s = self.section
        return s.tp * s.pp * s.dp


def init_distributed(rank: int, world: int, address: str, *, timeout_s: float = 600.0) -> str:
    """Join the pool's process group at ``address`` (``host:port`` of rank 0)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
    from datetime import timedelta

    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


class MegatronRank:
    """The model, optimizer and Push of one rank; call in the order a step needs them."""

    def __init__(self, spec: RankSpec, *, version: int = 0) -> None:
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            raise RuntimeError("call init_distributed() before building a MegatronRank")
        s = spec.section
        if dist.get_world_size() != spec.world:
            raise ValueError(
                f"{dist.get_world_size()} processes joined, but trainer.dp x trainer.tp x "
                f"trainer.pp = {spec.world}"
            )
        self.spec = spec
        self.cpu = apply_cpu_patches()
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", 0)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp
            )
        elif (
            ps.get_tensor_model_parallel_world_size() != s.tp
            or ps.get_pipeline_model_parallel_world_size() != s.pp
        ):
            raise ValueError("this process's Megatron parallel state has another TP or PP size")
        self._ps = ps
        if not self.cpu:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(spec.seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        where = (self.tp_rank, self.dp_rank, self.pp_rank)
        if where != coordinates(dist.get_rank(), s.tp, s.dp):
            raise RuntimeError(
                f"Megatron placed rank {dist.get_rank()} at (tp, dp, pp) = {where}, not where "
                "the pool routes its data and Pushes"
            )
        self.gpt = gpt_config_from_hf(spec.hf_config, s.tp, dtype=spec.dtype)
        self.stage = Stage(self.pp_rank, s.pp, self.gpt.num_layers, self.gpt.tie_word_embeddings)
        self.converter = MegatronToHF(self.gpt, s.tp)
        with cpu_devices():  # a last stage's tied copy moves itself with .cuda()
            self.model = build_gpt(
                spec.hf_config,
                self.gpt,
                tp=s.tp,
                dtype=spec.dtype,
                cpu=self.cpu,
                stage=self.stage,
            )
        if not self.cpu:
            self.model = self.model.to(self.device)
        self.version = int(version)
        self.reference: VocabParallelBackend | None = None  # init_reference()
        self.reference_model: GPTModel | None = None
        self._pending: Any = None  # the background Push in flight
        self._stream: StreamedStep | None = None  # parts of the next step seen so far
        self._pusher: Any = None
        self._client: Any = None
        self.push_wait_s = 0.0
        if self.cpu:
            self.update: Any = CpuUpdate(
                self.model,
                s,
                dp_group=ps.get_data_parallel_group(),
                mp_group=ps.get_model_parallel_group(),
                embedding_group=ps.get_embedding_group() if _tied_across(self.stage) else None,
                before_update=self._fence,
            )
            forward = self.model
        else:
            self.update = MegatronUpdate(self.model, s, before_update=self._fence)
            forward = self.update.model
        self.backend = VocabParallelBackend(
            lambda ids, pos: forward(ids, pos, None),
            vocab_size=int(spec.hf_config["vocab_size"]),
            padded_vocab=self.gpt.vocab_size,
            tp_rank=self.tp_rank,
            tp_size=s.tp,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            device=self.device,
            update=self.update,
            pipeline=forward if s.pp > 1 else None,
            pp_group=ps.get_pipeline_model_parallel_group(),
        )

    def init_reference(self) -> None:
        """Build this rank's shard of the frozen reference policy (no-op without a KL term
        or once built, e.g. restored by ``load_checkpoint``): ``trainer.ref.path``'s
        weights, else a copy of the policy's weights now. Called by the first step, before
        any update, and by a checkpoint (whose reference a resumed run restores)."""
        s = self.spec.section
        if self.reference is not None or not s.uses_reference:
            return
        ref = self.new_reference_model()
        if s.ref.path:
            hf = {k: _host_array(torch.from_numpy(v), self.spec.dtype)
                  for k, v in reference_weights(s.ref.path).items()}  # fmt: skip
            load_shard(ref, self.converter.shard(hf, self.tp_rank), self.stage)
        else:
            with torch.no_grad():
                for (_, q), (_, p) in zip(
                    ref.named_parameters(), self.model.named_parameters(), strict=True
                ):
                    q.copy_(p)
        self.use_reference(ref)

    def new_reference_model(self) -> GPTModel:
        """A model shaped like this rank's shard of the policy, for the reference's
        weights (filled by :meth:`init_reference` or a checkpoint)."""
        with cpu_devices():
            ref = build_gpt(
                self.spec.hf_config, self.gpt, tp=self.spec.section.tp, dtype=self.spec.dtype,
                cpu=self.cpu, stage=self.stage,
            )  # fmt: skip
        return ref if self.cpu else ref.to(self.device)

    def use_reference(self, ref: GPTModel) -> None:
        """Make ``ref`` (from :meth:`new_reference_model`, weights in place) the frozen
        reference that scores each batch."""
        s = self.spec.section
        ref.requires_grad_(False)
        ref.eval()
        self.reference_model = ref
        self.reference = VocabParallelBackend(
            lambda ids, pos: ref(ids, pos, None),
            vocab_size=int(self.spec.hf_config["vocab_size"]),
            padded_vocab=self.gpt.vocab_size,
            tp_rank=self.tp_rank,
            tp_size=s.tp,
            tp_group=self._ps.get_tensor_model_parallel_group(),
            dp_group=self._ps.get_data_parallel_group(),
            device=self.device,
            update=None,
            pipeline=ref if s.pp > 1 else None,
            pp_group=self._ps.get_pipeline_model_parallel_group(),
        )

    # -- roles --------------------------------------------------------------------------

    @property
    def is_data_leader(self) -> bool:
        """Receives its replica's groups from the TS (and broadcasts them to its peers)."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def tp_ranks(self) -> list[int]:
        """The TP rank of every global rank."""
        s = self.spec.section
        return [coordinates(g, s.tp, s.dp)[0] for g in range(self.spec.world)]

    @property
    def stages(self) -> list[int]:
        """The pipeline stage of every global rank."""
        s = self.spec.section
        return [coordinates(g, s.tp, s.dp)[2] for g in range(self.spec.world)]

    # -- weights ------------------------------------------------------------------------

    def load_hf(self, weights: Mapping[str, np.ndarray]) -> None:
        """Load this rank's shard of HF-named ``weights`` (a PS version or a checkpoint)."""
        load_shard(self.model, self.converter.shard(weights, self.tp_rank), self.stage)

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's own parameters by global Megatron name (its stage's layers under
        their global numbers; a last stage's copy of tied embeddings left out): live, no
        copy."""
        return {n: p.detach() for n, p in parameters_by_name(self.model, self.stage).items()}

    def gather_hf(self) -> dict[str, np.ndarray] | None:
        """The whole model in HF names on global rank 0 (None elsewhere): the TP shards of
        every stage of the first replica, gathered and converted."""
        shard = {n: _host_array(t, self.spec.dtype) for n, t in self.local_weights().items()}
        group = self._ps.get_model_parallel_group()  # TP x PP
        if self.dp_rank != 0:
            return None
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self.tp_rank, shard), group=group)
        if dist.get_rank() != 0:
            return None
        per_tp: list[dict[str, np.ndarray]] = [{} for _ in range(self.spec.section.tp)]
        for tp_rank, part in gathered:
            per_tp[tp_rank].update(part)
        return self.converter.convert(per_tp)

    # -- training -----------------------------------------------------------------------

    def receive(self, part: TrainingBatch | None) -> TrainingBatch:
        """This replica's part of the batch: the data leader's ``part``, broadcast over the
        replica's TP x PP group to its peers (which pass None)."""
        s = self.spec.section
        if s.tp * s.pp == 1:
            if part is None:
                raise ValueError("a rank alone in its replica is its data leader; give it its part")
            return part
        box = [part]
        group = self._ps.get_model_parallel_group()
        dist.broadcast_object_list(box, src=self.dp_rank * s.tp, group=group)
        if box[0] is None:
            raise ValueError("the data leader of this replica got no part of the batch")
        return box[0]

    def train_step(self, part: TrainingBatch | None) -> dict[str, float]:
        """One step on this replica's part of the batch (None on non-leaders); returns the
        metrics, reduced over the replicas (equal on every rank). After :meth:`stream`,
        the part is the groups not streamed (possibly none) and the step covers both."""
        start = time.perf_counter()
        batch = self.receive(part)
        self.init_reference()
        self.push_wait_s = 0.0
        streamed, self._stream = self._stream, None
        if streamed is None:
            metrics = self._in_step(
                lambda: train_step(
                    self.backend,
                    batch,
                    self.spec.section,
                    version=self.version,
                    pad_id=self.spec.pad_id,
                    allow_empty=self.spec.section.dp > 1,
                    reference=self.reference,
                )[0]
            )
        else:
            self._in_step(lambda: streamed.add(batch))
            metrics = self._in_step(lambda: streamed.finish()[0])
        self.version += 1
        metrics["train/lr"] = float(self.spec.section.lr)
        metrics["train/step_time_s"] = time.perf_counter() - start
        metrics["train/push_wait_s"] = self.push_wait_s
        return metrics

    def stream(self, part: TrainingBatch | None) -> None:
        """Forward/backward on this replica's share of groups of the next step's batch
        (``trainer.stream``); every rank of the pool calls it, a replica's share may be
        empty. :meth:`train_step` adds the rest and updates."""
        batch = self.receive(part)
        self.init_reference()
        if self._stream is None:
            self._stream = StreamedStep(
                self.backend,
                self.spec.section,
                version=self.version,
                pad_id=self.spec.pad_id,
                reference=self.reference,
            )
        stream = self._stream
        self._in_step(lambda: stream.add(batch))

    def drop_stream(self) -> None:
        self._stream = None
        self.update.zero_grad()

    def _in_step(self, work: Callable[[], _R]) -> _R:
        self.model.eval()  # dropout is 0 anyway; eval keeps any stochastic layer off
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.spec.seed * 1_000_003 + self.version)
            return work()

    # -- Push ---------------------------------------------------------------------------

    def attach_push(self, target: Endpoint | Mapping[int, Sequence[ReplicaRoute]]) -> int:
        """Connect for sharded Pushes: ``target`` is one PS worker's endpoint, or every
        rank's routes to the PS replicas (``{global rank: [ReplicaRoute, ...]}``, the same
        on every rank), each of which then receives the whole model. Returns the bytes this
        rank sends per version."""

        routes = (
            {g: [ReplicaRoute("ps", target, same_node=True)] for g in range(self.spec.world)}
            if isinstance(target, Endpoint)
            else target
        )
        self._client = ShardPushGroup(
            self.converter,
            rank=dist.get_rank(),
            tp_ranks=self.tp_ranks,
            stages=self.stages,
            routes=routes,
        )
        self._pusher = BackgroundPusher(self._client, name=f"push-rank{dist.get_rank()}")
        return self._client.nbytes

    def push_replicas(self) -> list[str]:
        """The PS replicas this rank Pushes to."""
        return [] if self._client is None else self._client.replicas

    def refill_push(self, endpoints: Mapping[str, Any]) -> list[str]:
        """PS replicas were restarted (``endpoints``: where each replica serves now):
        finish the Push in flight, connect to the restarted ones and send them this rank's
        pieces of the current version. Every rank calls this between two steps; the
        replicas publish the version once all ranks' pieces arrived. Returns the replicas
        refilled."""
        if self._client is None:
            raise RuntimeError("attach_push() first")
        self.wait_push(timeout=600)
        moved = self._client.reconnect(endpoints)
        if moved:
            self._client.push_to(moved, self.local_weights(), self.version)
        return moved

    def push_bytes(self) -> dict[str, int]:
        """Bytes this rank sends each PS replica per version."""
        return {} if self._client is None else self._client.sent_bytes()

    def start_push(self) -> Any:
        """Push the current weights as :attr:`version` in the background; returns its
        :class:`~parameter_server.push.PushHandle` (timing filled in once done)."""
        if self._pusher is None:
            raise RuntimeError("attach_push() first")
        self._pending = self._pusher.push_async(self.version, self.local_weights())
        return self._pending

    def wait_push(self, timeout: float | None = None) -> int | None:
        """Wait for the Push in flight (its version if this rank completed it)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.wait(timeout)

    def _fence(self) -> None:
        if self._pending is not None:
            started = time.perf_counter()
            self.wait_push()
            self.push_wait_s += time.perf_counter() - started

    def close(self) -> None:
        try:
            self.wait_push(timeout=60)
        finally:
            if self._pusher is not None:
                self._pusher.close(timeout=30)
            if self._client is not None:
                self._client.close()


def _tied_across(stage: Stage) -> bool:
    """The first and last stage each hold the tied embeddings: their gradients are summed."""
    return stage.tied and stage.size > 1 and (stage.first or stage.last)


def _host_array(t: torch.Tensor, dtype: str) -> np.ndarray:

    if dtype == "bfloat16":
        t = t.to(torch.bfloat16)
    return to_numpy(t).copy()


def free_port() -> int:
    """A TCP port free on this host now (for rank 0's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def host_address() -> str:
    """An address of this host other ranks can reach (Ray's node IP when Ray is here)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
