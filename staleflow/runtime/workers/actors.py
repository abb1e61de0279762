"""The Ray actors of a real run, each a thin shell around a plain component.

============================  ===========================================================
actor                         component
============================  ===========================================================
``ParameterServerActor`` x R  a PS worker process (``parameter_server.worker``), one
                              per node that runs a rollout instance
trajectory server             ``trajectory_server.actor`` (already a service + client)
``RolloutActor`` x N          :class:`~staleflow.runtime.workers.instance_host.InstanceHost`
``RewardActor`` x W           :class:`~staleflow.runtime.workers.reward_stage.RewardStage`
``TrainerActor``              :class:`~staleflow.runtime.workers.training_loop.TrainingLoop` over
                              the embedded trainer
``PoolTrainerActor``          the same loop over a pool of rank actors (Megatron)
``ControlActor``              :class:`~staleflow.runtime.controller.control_plane.ControlPlane`
                              (``staleflow.runtime.controller.actor``)
============================  ===========================================================

Peers reach each other through clients, which give a component the same blocking API
its in-process peer would: the instance client below, and the control actor's
(:mod:`staleflow.runtime.workers.control_client`). Ray is imported only when an actor
is created, so importing this module does not import it.

Recovery (``docs/recovery.md``): an instance client turns the death of its actor into
:class:`~staleflow.runtime.interface.InstanceGone`; every incarnation of an instance has
its own holder id in the TS and hands finished trajectories to a reward worker through
the TS (``hand_to_reward``), so a lost instance or reward worker costs only its work in
flight; PS clients reconnect to a restarted replica (``staleflow.runtime.workers.ps_healing``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from coordinator.types import InstanceSnapshot
from parameter_server import BackgroundPusher, Layout
from parameter_server.transport import connect
from parameter_server.worker import PSWorker
from staleflow.control.late import hand_live
from staleflow.rollout.eval_lane import EvalOutput, EvalRequest
from staleflow.rollout.instance import CopyEnd, Finished, InstanceTimes
from staleflow.runtime.backends import load_hook
from staleflow.runtime.interface import InstanceGone, StepReport
from staleflow.runtime.placement.ray_cluster import import_ray
from staleflow.runtime.workers.audit_trail import AuditedBatches
from staleflow.runtime.workers.control_client import WorkerControl
from staleflow.runtime.workers.instance_host import InstanceHost
from staleflow.runtime.workers.ps_healing import HealingPull, HealingPush
from staleflow.runtime.workers.reward_stage import finished_from_task
from staleflow.runtime.workers.specs import build_embedded_trainer, build_reward_stage
from staleflow.runtime.workers.training_loop import TrainingLoop
from trajectory_server.actor import TrajectoryServerClient
from trajectory_server.types import FinishedTrajectory, InstanceId, RewardTask

if TYPE_CHECKING:
    import numpy as np
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from parameter_server.replicas import ReplicaRoute
    from parameter_server.store import StoreInfo
    from parameter_server.transport.base import Endpoint
    from staleflow.runtime.workers.ps_healing import ReplicaResolver
    from staleflow.runtime.workers.specs import (
        EnginePlacement,
        RewardSpec,
        RolloutSpec,
        TrainerSpec,
    )
    from staleflow.trainers.megatron.pool import MegatronTrainer
    from trajectory_server.actor import TrajectoryServerService

    TSHandle = ActorHandle[TrajectoryServerService]

T = TypeVar("T")

logger = logging.getLogger(__name__)


def process_env(threads: int, *, quiet_downloads: bool = False) -> dict[str, str]:
    """The environment of one actor's process, given in its ``runtime_env`` so that Ray
    sets it before the process starts (OpenMP reads ``OMP_NUM_THREADS`` once, when torch
    loads). ``quiet_downloads`` turns off Hugging Face's progress bars in that process
    only (a bar per checkpoint shard garbles the driver's display)."""
    env = {"OMP_NUM_THREADS": str(max(1, threads)), "MKL_NUM_THREADS": str(max(1, threads))}
    if quiet_downloads:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return env


def _torch_threads(n: int) -> None:
    """torch's intra-op threads of this actor's process (several share a small machine)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, n))


@dataclass(frozen=True)
class InstanceRecovery:
    """What an actor needs to recover by itself: how often it reports progress, and how
    it finds (and how long it waits for) a restarted PS replica."""

    resolver: Any = None  # staleflow.runtime.workers.ps_healing.ReplicaResolver
    progress_every_s: float = 0.0
    ps_patience_s: float = 120.0


# -- clients -----------------------------------------------------------------------------


def gone(inst: int, exc: BaseException) -> InstanceGone | None:
    """``exc`` as an :class:`InstanceGone` when it says the instance cannot serve (its
    actor died, or it raised InstanceGone itself); None for any other error."""
    ray = import_ray()
    if isinstance(exc, InstanceGone):
        return InstanceGone(exc.inst, exc.reason)
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, InstanceGone):
        return InstanceGone(cause.inst, cause.reason)
    if isinstance(exc, ray.exceptions.RayActorError):
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return InstanceGone(inst, f"its actor died ({lines[0][:200] if lines else 'no reason'})")
    return None


class InstanceClient:
    """``InstanceHandle`` over a ``RolloutActor``; a dead actor is ``InstanceGone``."""

    def __init__(self, handle: ActorHandle[RolloutActor], inst: int = -1) -> None:
        self._ray = import_ray()
        self.handle = handle
        self.inst = inst

    def _get(self, ref: ObjectRef[T]) -> T:
        try:
            return self._ray.get(ref)
        except Exception as exc:
            lost = gone(self.inst, exc)
            if lost is None:
                raise
            raise lost from exc

    def snapshot(self) -> InstanceSnapshot:
        return self._get(self.handle.snapshot.remote())

    def route(self, traj_ids: Sequence[int], v_traj: Mapping[int, int]) -> tuple[int, ...]:
        return self._get(self.handle.route.remote(list(traj_ids), dict(v_traj)))

    def interrupt(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return self._get(self.handle.interrupt.remote(list(traj_ids)))

    def abort(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return self._get(self.handle.abort.remote(list(traj_ids)))

    def pull(self, at_least: int) -> int:
        return self._get(self.handle.pull.remote(at_least))

    def times(self) -> InstanceTimes:
        return self._get(self.handle.times.remote())

    def drop_prefixes(self, traj_ids: Sequence[int]) -> None:
        # not waited for: the control loop goes on, and a lost instance lost them anyway
        self.handle.drop_prefixes.remote(list(traj_ids))

    # the tail race (runtime/races.py)
    def prepare_race(self, traj_id: int) -> bool:
        return self._get(self.handle.prepare_race.remote(traj_id))

    def race(self, traj_id: int, holder: InstanceId, draft_method: str | None = None) -> int | None:
        return self._get(self.handle.race.remote(traj_id, holder, draft_method))

    def drop_copies(self, traj_ids: Sequence[int]) -> dict[int, CopyEnd]:
        return self._get(self.handle.drop_copies.remote(list(traj_ids)))

    def settle_won(self, traj_ids: Sequence[int]) -> dict[int, int]:
        return self._get(self.handle.settle_won.remote(list(traj_ids)))


# -- actor bodies (made remote by the pool builders, staleflow.runtime.driver.pools) --------------


class ParameterServerActor:
    """One PS replica: a worker process on this actor's node. With ``tcp`` it listens on
    the node's address, so clients on other nodes reach it (else a Unix socket). With
    ``base`` (``trainer.lora``) its versions are adapters and it holds that base once."""

    def __init__(
        self,
        layout: dict[str, Any],
        num_slots: int,
        nixl: bool,
        tcp: bool,
        base: dict[str, Any] | None = None,
    ) -> None:

        address = f"tcp:{import_ray().util.get_node_ip_address()}:0" if tcp else None
        self._worker = PSWorker.start(
            Layout.from_dict(layout),
            num_slots,
            nixl=nixl,
            address=address,
            base=None if base is None else Layout.from_dict(base),
        )

    def endpoint(self) -> Endpoint:
        return self._worker.endpoint

    def info(self) -> StoreInfo:
        with connect(self._worker.endpoint, "socket") as client:
            return client.info()

    def alive(self) -> bool:
        return self._worker.alive

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self._worker.stop()


class RolloutActor:
    """One incarnation of a rollout instance: it Pulls from the PS replica on its own
    node (``pull``; reconnecting when that replica is restarted), builds its engine with
    the backend's hook ``engine_builder``, names itself ``holder`` in the TS, and hands
    what finishes to a reward worker through the TS."""

    def __init__(
        self,
        inst: int,
        spec: RolloutSpec,
        pull: ReplicaRoute,
        ts_handle: TSHandle,
        rewards: Mapping[str, Any],
        engine_builder: str,
        placement: EnginePlacement,
        holder: str = "",
        recovery: InstanceRecovery | None = None,
        at_least: int = 0,
    ) -> None:

        _torch_threads(spec.rollout.num_threads)
        self._ray = import_ray()
        rec = recovery or InstanceRecovery()
        self._holder = holder or str(inst)
        self._ts = TrajectoryServerClient(ts_handle)
        self._rewards = dict(rewards)  # worker id -> RewardActor
        self._rewards_lock = threading.Lock()
        self._next_reward = inst  # spread instances over the pool
        # reward calls in flight: appended by the generation thread, checked by snapshot()
        self._in_flight: list[Any] = []
        self._in_flight_lock = threading.Lock()
        self.reward_losses = 0
        # the run's seed on every instance: draws are keyed by trajectory and token index
        # (engines/embedded/sampling.py), so a trajectory samples the same tokens wherever
        # it runs, which a race copy needs (runtime/races.py)
        engine = load_hook(engine_builder)(spec, spec.seed, placement)
        weights = HealingPull(pull, Layout.from_dict(spec.layout), rec.resolver, rec.ps_patience_s)
        self._pull = (pull.replica, weights.name)
        self._host = InstanceHost(
            inst,
            engine,
            ts=self._ts,
            weights=weights,
            max_response=spec.rollout.max_response_tokens,
            on_finished=self._dispatch,
            holder=self._holder,
            chunk_tokens=spec.chunk_tokens,
            on_copy_finished=self._dispatch_copies,
            eval_running=spec.eval_running,
        )
        self._host.start(at_least, rec.progress_every_s)

    def pull_route(self) -> tuple[str, str]:
        """(the replica this instance Pulls from, the transport it uses)."""
        return self._pull

    def set_rewards(self, rewards: Mapping[str, Any]) -> None:
        """The reward workers alive now (the supervisor replaced a lost one)."""
        with self._rewards_lock:
            self._rewards = dict(rewards)

    def _dispatch_copies(self, pairs: list[tuple[Finished, InstanceId]]) -> list[int]:
        """Race copies finished here: each goes to a reward worker in its holder's name
        (the TS takes it only while the trajectory is ROUTED there: the first to finish)."""
        won: list[int] = []
        for holder in dict.fromkeys(h for _, h in pairs):
            won += self._dispatch([f for f, h in pairs if h == holder], holder)
        return won

    def _dispatch(self, finished: list[Finished], holder: InstanceId | None = None) -> list[int]:

        with self._rewards_lock:
            workers = list(self._rewards.items())
        worker_id, target = workers[self._next_reward % len(workers)]
        self._next_reward += 1
        # the TS first: it then knows which worker scores them, should that worker die
        kept = set(
            hand_live(
                self._ts,
                [
                    FinishedTrajectory(
                        t.traj_id, t.tokens, t.logprobs, t.versions, t.finish_reason, t.mask
                    )
                    for t in (f.task for f in finished)
                ],
                worker_id,
                instance_id=self._holder if holder is None else holder,
            )
        )
        sent = [f for f in finished if f.task.traj_id in kept]
        if not sent:
            return []
        ref = target.process.remote(sent)
        with self._in_flight_lock:
            self._in_flight.append(ref)
        return [f.task.traj_id for f in sent]

    def _check_rewards(self) -> None:
        """Surface a failed reward call here (a lost completion would stall training);
        a reward worker that died is the supervisor's to replace, not a failure."""
        with self._in_flight_lock:
            refs, self._in_flight = self._in_flight, []
        if not refs:
            return
        done, pending = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        with self._in_flight_lock:
            self._in_flight[:0] = pending
        for ref in done:
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                self.reward_losses += 1  # its trajectories are REWARDING in the TS

    def snapshot(self) -> InstanceSnapshot:
        self._check_rewards()
        return self._host.snapshot()

    def route(self, traj_ids: list[int], v_traj: dict[int, int]) -> tuple[int, ...]:
        return self._host.route(traj_ids, v_traj)

    def interrupt(self, traj_ids: list[int]) -> tuple[int, ...]:
        return self._host.interrupt(traj_ids)

    def abort(self, traj_ids: list[int]) -> tuple[int, ...]:
        return self._host.abort(traj_ids)

    def pull(self, at_least: int) -> int:
        return self._host.pull(at_least)

    def prepare_race(self, traj_id: int) -> bool:
        return self._host.prepare_race(traj_id)

    def race(self, traj_id: int, holder: InstanceId, draft_method: str | None = None) -> int | None:
        return self._host.race(traj_id, holder, draft_method)

    def drop_copies(self, traj_ids: list[int]) -> dict[int, CopyEnd]:
        return self._host.drop_copies(traj_ids)

    def settle_won(self, traj_ids: list[int]) -> dict[int, int]:
        return self._host.settle_won(traj_ids)

    def submit_eval(self, requests: list[EvalRequest]) -> int:
        """Evaluation requests (not trajectories: never in the TS); returns how many."""
        return self._host.submit_eval(requests)

    def take_eval(self) -> list[EvalOutput]:
        return self._host.take_eval()

    def version(self) -> int:
        """The version of the weights loaded (what a joining instance Pulled)."""
        return self._host.instance.version

    def times(self) -> InstanceTimes:
        return self._host.times()

    def held(self) -> set[int]:
        return self._host.held()

    def held_prefixes(self) -> tuple[int, ...]:
        return self._host.held_prefixes()

    def drop_prefixes(self, traj_ids: list[int]) -> list[int]:
        return self._host.drop_prefixes(traj_ids)

    def pid(self) -> int:
        return os.getpid()

    def drain(self) -> int:
        """Wait for the reward calls in flight; returns how many there were."""
        with self._in_flight_lock:
            refs, self._in_flight = self._in_flight, []
        for ref in refs:
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                self.reward_losses += 1
        return len(refs)

    def stop(self) -> None:
        self._host.stop()


class RewardActor:
    """A reward worker; ``worker_id`` names this incarnation in the TS, which refuses its
    completions of trajectories reassigned to another worker."""

    def __init__(
        self,
        spec: RewardSpec,
        ts_handle: TSHandle,
        control_handle: ActorHandle,
        worker_id: str = "",
    ) -> None:

        self._stage = build_reward_stage(
            spec,
            TrajectoryServerClient(ts_handle),
            WorkerControl(control_handle).rewarded,
            worker_id or None,
        )

    def process(self, finished: list[Finished]) -> int:
        self._stage.process(finished)
        return len(finished)

    def process_tasks(self, tasks: list[RewardTask]) -> int:
        """Score trajectories handed to a worker that was lost (``reassign_rewards``)."""
        return self.process([finished_from_task(t) for t in tasks])

    def score_eval(self, responses: list[tuple[np.ndarray, str]]) -> list[float]:
        """Rewards of held-out evaluation responses (tokens, ground truth), by the run's
        reward function; no trajectories: nothing goes to the TS or the control plane."""
        score = getattr(self._stage, "score", None)
        if score is None:  # the config refuses eval.every with an environment task
            raise RuntimeError("an environment task's reward worker cannot score evaluations")
        return score(responses)

    def ping(self) -> int:
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()


class _TrainingHost:
    """What the trainer actors share: the training loop (``TrainingLoop``) and the
    trainer's part of a run checkpoint, written by ``self.trainer`` when the driver asks
    (the control plane's checkpoint cuts, ``docs/recovery.md``)."""

    trainer: Any
    _loop: Any

    def run(self, steps: int) -> list[StepReport]:
        return self._loop.run(steps)

    def version(self) -> int:
        return int(self.trainer.version)

    def save_checkpoint(self, path: str) -> str:
        self.trainer.save_checkpoint(path)
        return path

    def pid(self) -> int:
        return os.getpid()


class TrainerActor(_TrainingHost):
    """The embedded trainer: one rank that Pushes every version to every PS replica (the
    one on its own node over shared memory, the others over NIXL or TCP). It runs with
    two threads: ``run`` holds one, and ``save_checkpoint`` / ``refill_ps`` may come on the
    other while it waits for a buffer (the trainer's lock keeps them apart from a step)."""

    def __init__(
        self,
        spec: TrainerSpec,
        push: Sequence[ReplicaRoute],
        ts_handle: TSHandle,
        control_handle: ActorHandle,
        name: str = "trainer/0",
        recovery: InstanceRecovery | None = None,
        resume_from: str = "",
    ) -> None:
        import numpy as np

        _torch_threads(spec.trainer.num_threads)
        rec = recovery or InstanceRecovery()
        self._replicas = HealingPush(push, name, rec.resolver, rec.ps_patience_s)
        layout = Layout.from_dict(spec.layout)
        buffer = np.empty(layout.nbytes, dtype=np.uint8)
        self._replicas.pull(buffer, None)  # the first weights, from the nearest replica
        base = None
        if spec.model.base_layout is not None:  # LoRA: the adapter's frozen base, once
            base_layout = Layout.from_dict(spec.model.base_layout)
            base_buffer = np.empty(base_layout.nbytes, dtype=np.uint8)
            self._replicas.pull_base(base_buffer)
            base = base_layout.views(base_buffer)
        self.trainer = build_embedded_trainer(spec, layout.views(buffer), base)
        if resume_from:  # weights, optimizer, RNG and version of a run checkpoint
            self.trainer.load_checkpoint(resume_from)
        self._pusher = BackgroundPusher(self._replicas, name="trainer-push")
        ts: Any = TrajectoryServerClient(ts_handle)
        if spec.audit_path:
            ts = AuditedBatches(ts, spec.audit_path, lambda: self.trainer.version)
        self._loop = TrainingLoop(
            self.trainer,
            control=WorkerControl(control_handle),
            ts=ts,
            pusher=self._pusher,
            consume_timeout_s=spec.consume_timeout_s,
            stream=spec.trainer.stream,
        )

    def push_transports(self) -> dict[str, str]:
        """The transport each replica's Push takes (after any fallback)."""
        return self._replicas.transports()

    def refill_ps(self) -> int:
        """A PS replica was restarted: give it the newest weights (the trainer's own);
        returns how many replicas took them (with LoRA, the base first where it is missing)."""
        base = self.trainer.export_base_weights() if self.trainer.lora else None
        return self._replicas.refill(self.trainer.export_weights(), self.trainer.version, base)

    def stop(self) -> None:
        self._pusher.close(timeout=30)
        self._replicas.close()


class PoolTrainerActor(_TrainingHost):
    """The training loop over a pool of rank actors (``trainer.backend=megatron``):
    ``driver`` is the pool's :class:`~staleflow.runtime.workers.training_loop.StepDriver`. The ranks take
    their parts of each batch from the TS and Push their own shards; this actor moves only
    group ids and metrics."""

    def __init__(
        self, spec: TrainerSpec, driver: MegatronTrainer, control_handle: ActorHandle
    ) -> None:

        self.trainer = driver
        self._loop = TrainingLoop(
            driver,
            control=WorkerControl(control_handle),
            consume_timeout_s=spec.consume_timeout_s,
            stream=spec.trainer.stream,
        )

    def refill_ps(self, resolve: ReplicaResolver) -> int:
        """A PS replica was restarted: the ranks give it the current version (``resolve``:
        a :class:`~staleflow.runtime.workers.ps_healing.ReplicaResolver`); returns how many
        replicas took it."""
        return int(self.trainer.refill_ps(resolve))

    def stop(self) -> None:
        self.trainer.close()
