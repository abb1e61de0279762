"""The Ray actors of a real run, each a thin shell around a plain component.

============================  ===========================================================
actor                         component
============================  ===========================================================
``ParameterServerActor`` x R  a PS worker process (``parameter_server.worker``), one
                              per node that runs a rollout instance
trajectory server             ``trajectory_server.actor`` (already a service + client)
``RolloutActor`` x N          :class:`~staleflow.runtime.instance_host.InstanceHost`
``RewardActor`` x W           :class:`~staleflow.runtime.reward_stage.RewardStage`
``TrainerActor``              :class:`~staleflow.runtime.training.TrainingLoop` over
                              the embedded trainer
``PoolTrainerActor``          the same loop over a pool of rank actors (Megatron)
``ControlActor``              :class:`~staleflow.runtime.control.ControlPlane`
============================  ===========================================================

Peers reach each other through the clients below, which give a component the same
blocking API its in-process peer would. Ray is imported only when an actor is created,
so importing this module does not import it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from coordinator.types import InstanceSnapshot
from parameter_server.transport import connect
from staleflow.rollout.instance import Finished, InstanceTimes
from staleflow.runtime.interface import Rewarded, StepReport
from staleflow.runtime.record import StepRecord
from staleness.types import ConsumedBatch
from trajectory_server.types import AbortedTrajectory

if TYPE_CHECKING:
    from parameter_server.replicas import ReplicaRoute
    from parameter_server.store import StoreInfo
    from parameter_server.transport.base import Endpoint
    from staleflow.runtime.components import (
        EnginePlacement,
        RewardSpec,
        RolloutSpec,
        TrainerSpec,
    )
    from staleflow.runtime.control import ControlConfig

logger = logging.getLogger(__name__)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        from staleflow.install import missing

        raise ImportError(
            missing("ray (staleflow launch runs its components as Ray actors)", exc)
        ) from exc
    return ray


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


# -- clients -----------------------------------------------------------------------------


class InstanceClient:
    """``InstanceHandle`` over a ``RolloutActor``."""

    def __init__(self, handle: Any) -> None:
        self._ray = _ray()
        self.handle = handle

    def _get(self, ref: Any) -> Any:
        return self._ray.get(ref)

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


class ControlClient:
    """``ControlHandle`` over a ``ControlActor``."""

    def __init__(self, handle: Any) -> None:
        self._ray = _ray()
        self.handle = handle

    def rewarded(self, records: Sequence[Rewarded]) -> None:
        self._ray.get(self.handle.rewarded.remote(list(records)))

    def consume(self, version: int, timeout_s: float | None = None) -> ConsumedBatch:
        return self._ray.get(self.handle.consume.remote(version, timeout_s))

    def dropped(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        self._ray.get(self.handle.dropped.remote(list(trajectories)))

    def trained(self, report: StepReport) -> None:
        self._ray.get(self.handle.trained.remote(report))


# -- actor bodies (made remote by the pool builders, staleflow.runtime.pools) --------------


class ParameterServerActor:
    """One PS replica: a worker process on this actor's node. With ``tcp`` it listens on
    the node's address, so clients on other nodes reach it (else a Unix socket)."""

    def __init__(self, layout: dict[str, Any], num_slots: int, nixl: bool, tcp: bool) -> None:
        from parameter_server import Layout
        from parameter_server.worker import PSWorker

        address = f"tcp:{_ray().util.get_node_ip_address()}:0" if tcp else None
        self._worker = PSWorker.start(
            Layout.from_dict(layout), num_slots, nixl=nixl, address=address
        )

    def endpoint(self) -> Endpoint:
        return self._worker.endpoint

    def info(self) -> StoreInfo:
        with connect(self._worker.endpoint, "socket") as client:
            return client.info()

    def alive(self) -> bool:
        return self._worker.alive

    def stop(self) -> None:
        self._worker.stop()


class RolloutActor:
    """One rollout instance; it Pulls from the PS replica at the end of ``pull`` (the one
    on its own node) and builds its engine with the backend's hook ``engine_builder``."""

    def __init__(
        self,
        inst: int,
        spec: RolloutSpec,
        pull: ReplicaRoute,
        ts_handle: Any,
        reward_handles: Sequence[Any],
        engine_builder: str,
        placement: EnginePlacement,
    ) -> None:
        from parameter_server import Layout
        from parameter_server.replicas import connect_replica
        from staleflow.runtime.backends import load_hook
        from staleflow.runtime.instance_host import InstanceHost
        from staleflow.runtime.weights import TransportPullSource
        from trajectory_server.actor import TrajectoryServerClient

        _torch_threads(spec.rollout.num_threads)
        self._ray = _ray()
        self._rewards = list(reward_handles)
        self._next_reward = inst  # spread instances over the pool
        # reward calls in flight: appended by the generation thread, checked by snapshot()
        self._in_flight: list[Any] = []
        self._in_flight_lock = threading.Lock()
        engine = load_hook(engine_builder)(spec, spec.seed + inst, placement)
        transport = connect_replica(pull)
        self._pull = (pull.replica, transport.name)
        weights = TransportPullSource(transport, Layout.from_dict(spec.layout))
        self._host = InstanceHost(
            inst,
            engine,
            ts=TrajectoryServerClient(ts_handle),
            weights=weights,
            max_response=spec.rollout.max_response_tokens,
            on_finished=self._dispatch,
            chunk_tokens=spec.chunk_tokens,
        )
        self._host.start(0)

    def pull_route(self) -> tuple[str, str]:
        """(the replica this instance Pulls from, the transport it uses)."""
        return self._pull

    def _dispatch(self, finished: list[Finished]) -> None:
        target = self._rewards[self._next_reward % len(self._rewards)]
        self._next_reward += 1
        ref = target.process.remote(finished)
        with self._in_flight_lock:
            self._in_flight.append(ref)

    def _check_rewards(self) -> None:
        """Surface a failed reward call here (a lost completion would stall training)."""
        with self._in_flight_lock:
            refs, self._in_flight = self._in_flight, []
        if not refs:
            return
        done, pending = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        with self._in_flight_lock:
            self._in_flight[:0] = pending
        self._ray.get(done)

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

    def times(self) -> InstanceTimes:
        return self._host.times()

    def held(self) -> set[int]:
        return self._host.held()

    def drain(self) -> int:
        """Wait for the reward calls in flight; returns how many there were."""
        with self._in_flight_lock:
            refs, self._in_flight = self._in_flight, []
        self._ray.get(refs)
        return len(refs)

    def stop(self) -> None:
        self._host.stop()


class RewardActor:
    def __init__(self, spec: RewardSpec, ts_handle: Any, control_handle: Any) -> None:
        from staleflow.runtime.components import build_reward_stage
        from trajectory_server.actor import TrajectoryServerClient

        self._stage = build_reward_stage(
            spec, TrajectoryServerClient(ts_handle), ControlClient(control_handle).rewarded
        )

    def process(self, finished: list[Finished]) -> int:
        self._stage.process(finished)
        return len(finished)


class _TrainingHost:
    """What the trainer actors share: the training loop (``TrainingLoop``) and a checkpoint
    every ``checkpoint_every`` steps, written by ``self.trainer``."""

    trainer: Any
    _loop: Any
    _spec: TrainerSpec

    def _maybe_checkpoint(self, report: StepReport) -> None:
        every, folder = self._spec.checkpoint_every, self._spec.checkpoint_dir
        step = report.version + 1
        if every > 0 and folder and step % every == 0:
            self.save_checkpoint(os.path.join(folder, f"step-{step}"))

    def run(self, steps: int) -> list[StepReport]:
        return self._loop.run(steps)

    def save_checkpoint(self, path: str) -> str:
        self.trainer.save_checkpoint(path)
        return path


class TrainerActor(_TrainingHost):
    """The embedded trainer: one rank that Pushes every version to every PS replica (the
    one on its own node over shared memory, the others over NIXL or TCP)."""

    def __init__(
        self,
        spec: TrainerSpec,
        push: Sequence[ReplicaRoute],
        ts_handle: Any,
        control_handle: Any,
        name: str = "trainer/0",
    ) -> None:
        import numpy as np

        from parameter_server import BackgroundPusher, Layout
        from parameter_server.replicas import replica_group
        from staleflow.runtime.components import build_embedded_trainer
        from staleflow.runtime.training import TrainingLoop
        from trajectory_server.actor import TrajectoryServerClient

        _torch_threads(spec.trainer.num_threads)
        self._replicas = replica_group(push, receiver=name)
        layout = Layout.from_dict(spec.layout)
        buffer = np.empty(layout.nbytes, dtype=np.uint8)
        self._replicas.pull(buffer, 0)  # the initial weights, from the nearest replica
        self.trainer = build_embedded_trainer(spec, layout.views(buffer))
        self._pusher = BackgroundPusher(self._replicas, name="trainer-push")
        self._loop = TrainingLoop(
            self.trainer,
            control=ControlClient(control_handle),
            ts=TrajectoryServerClient(ts_handle),
            pusher=self._pusher,
            consume_timeout_s=spec.consume_timeout_s,
            on_step=self._maybe_checkpoint,
        )
        self._spec = spec

    def push_transports(self) -> dict[str, str]:
        """The transport each replica's Push takes (after any fallback)."""
        return self._replicas.transports()

    def stop(self) -> None:
        self._pusher.close(timeout=30)
        self._replicas.close()


class PoolTrainerActor(_TrainingHost):
    """The training loop over a pool of rank actors (``trainer.backend=megatron``):
    ``driver`` is the pool's :class:`~staleflow.runtime.training.StepDriver`. The ranks take
    their parts of each batch from the TS and Push their own shards; this actor moves only
    group ids and metrics."""

    def __init__(self, spec: TrainerSpec, driver: Any, control_handle: Any) -> None:
        from staleflow.runtime.training import TrainingLoop

        self.trainer = driver
        self._spec = spec
        self._loop = TrainingLoop(
            driver,
            control=ControlClient(control_handle),
            consume_timeout_s=spec.consume_timeout_s,
            on_step=self._maybe_checkpoint,
        )

    def stop(self) -> None:
        self.trainer.close()


class ControlActor:
    """Runs with several threads: ``consume`` blocks one of them until the buffer is
    Ready while ``rewarded`` calls keep arriving on the others."""

    def __init__(self, config: ControlConfig, ts_handle: Any) -> None:
        from trajectory_server.actor import TrajectoryServerClient

        self._config = config
        self._ts = TrajectoryServerClient(ts_handle)
        self._plane: Any = None
        self._versions: Any = None
        self._placement: dict[str, Any] = {}

    def attach(
        self, instance_handles: Mapping[int, Any], ps_endpoints: Mapping[str, Endpoint]
    ) -> None:
        """Start the loop over the instances; the PS version is the newest that every
        replica holds (what any instance's Pull gets at least)."""
        from parameter_server.replicas import ReplicaVersions
        from staleflow.runtime.control import ControlPlane

        ray = _ray()
        clients = {i: InstanceClient(h) for i, h in instance_handles.items()}
        pool = ThreadPoolExecutor(max(4, len(clients)), thread_name_prefix="commands")
        handles = dict(instance_handles)
        self._versions = ReplicaVersions(ps_endpoints, client="control")

        def gather() -> list[InstanceSnapshot]:
            return ray.get([h.snapshot.remote() for h in handles.values()])

        self._plane = ControlPlane(
            self._config,
            ts=self._ts,
            instances=clients,
            ps_version=lambda: self._versions.latest() or 0,
            gather=gather,
            run_round=lambda actions: list(pool.map(lambda a: a(), actions)),
        )
        self._plane.start()

    def set_placement(self, placement: dict[str, Any]) -> None:
        """Where the run's actors are and how weights travel (``staleflow status`` and the
        dashboard read it from any node)."""
        self._placement = dict(placement)

    def placement(self) -> dict[str, Any]:
        return self._placement

    def rewarded(self, records: list[Rewarded]) -> None:
        self._plane.rewarded(records)

    def consume(self, version: int, timeout_s: float | None) -> ConsumedBatch:
        return self._plane.consume(version, timeout_s)

    def dropped(self, trajectories: list[AbortedTrajectory]) -> None:
        self._plane.dropped(trajectories)

    def trained(self, report: StepReport) -> None:
        self._plane.trained(report)

    def records(self, since: int = 0) -> list[StepRecord]:
        return self._plane.records(since)

    def live(self) -> Any:
        return self._plane.live()

    def staleness(self) -> dict[int, int]:
        return dict(self._plane.staleness_of_consumed())

    def stop(self) -> None:
        if self._plane is not None:
            self._plane.stop()
        if self._versions is not None:
            self._versions.close()
            self._versions = None
