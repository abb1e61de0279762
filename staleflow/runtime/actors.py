"""The Ray actors of a real run, each a thin shell around a plain component.

============================  ===========================================================
actor                         component
============================  ===========================================================
``ParameterServerActor``      a PS worker process (``parameter_server.worker``)
trajectory server             ``trajectory_server.actor`` (already a service + client)
``RolloutActor`` x N          :class:`~staleflow.runtime.instance_host.InstanceHost`
``RewardActor`` x W           :class:`~staleflow.runtime.reward_stage.RewardStage`
``TrainerActor``              :class:`~staleflow.runtime.training.TrainingLoop`
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
from typing import Any

from coordinator.types import InstanceSnapshot
from staleflow.rollout.instance import Finished, InstanceTimes
from staleflow.runtime.interface import Rewarded, StepReport
from staleness.types import ConsumedBatch
from trajectory_server.types import AbortedTrajectory

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


def _threads(n: int) -> None:
    """Limit this actor process's torch threads (several share a small machine)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
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


# -- actor bodies (made remote by spawn()) ------------------------------------------------


class ParameterServerActor:
    def __init__(self, layout: dict[str, Any], num_slots: int, nixl: bool, tcp_host: str) -> None:
        from parameter_server import Layout
        from parameter_server.worker import PSWorker

        address = f"tcp:{tcp_host}:0" if tcp_host else None
        self._worker = PSWorker.start(
            Layout.from_dict(layout), num_slots, nixl=nixl, address=address
        )

    def endpoint(self) -> Any:
        return self._worker.endpoint

    def alive(self) -> bool:
        return self._worker.alive

    def stop(self) -> None:
        self._worker.stop()


class RolloutActor:
    def __init__(
        self,
        inst: int,
        spec: Any,  # staleflow.runtime.components.RolloutSpec
        ps_endpoint: Any,
        ts_handle: Any,
        reward_handles: Sequence[Any],
    ) -> None:
        from parameter_server import Layout
        from parameter_server.transport import connect
        from staleflow.runtime.components import build_engine
        from staleflow.runtime.instance_host import InstanceHost
        from staleflow.runtime.weights import TransportPullSource
        from trajectory_server.actor import TrajectoryServerClient

        _threads(spec.num_threads)
        self._ray = _ray()
        self._rewards = list(reward_handles)
        self._next_reward = inst  # spread instances over the pool
        # reward calls in flight: appended by the generation thread, checked by snapshot()
        self._in_flight: list[Any] = []
        self._in_flight_lock = threading.Lock()
        engine = build_engine(spec, seed=spec.seed + inst)
        weights = TransportPullSource(
            connect(ps_endpoint, spec.transport), Layout.from_dict(spec.layout)
        )
        self._host = InstanceHost(
            inst,
            engine,
            ts=TrajectoryServerClient(ts_handle),
            weights=weights,
            max_response=spec.max_response,
            on_finished=self._dispatch,
        )
        self._host.start(0)

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
    def __init__(self, spec: Any, ts_handle: Any, control_handle: Any) -> None:
        from staleflow.runtime.components import build_reward_stage
        from trajectory_server.actor import TrajectoryServerClient

        self._stage = build_reward_stage(
            spec, TrajectoryServerClient(ts_handle), ControlClient(control_handle).rewarded
        )

    def process(self, finished: list[Finished]) -> int:
        self._stage.process(finished)
        return len(finished)


class TrainerActor:
    def __init__(self, spec: Any, ps_endpoint: Any, ts_handle: Any, control_handle: Any) -> None:
        from parameter_server import BackgroundPusher, Layout
        from parameter_server.transport import connect
        from staleflow.runtime.components import build_trainer
        from staleflow.runtime.training import TrainingLoop
        from staleflow.runtime.weights import TransportPullSource
        from trajectory_server.actor import TrajectoryServerClient

        _threads(spec.num_threads)
        transport = connect(ps_endpoint, spec.transport)
        _, weights = TransportPullSource(transport, Layout.from_dict(spec.layout)).fetch(0)
        self.trainer = build_trainer(spec, weights)
        self._pusher = BackgroundPusher(transport, name="trainer-push")
        self._loop = TrainingLoop(
            self.trainer,
            control=ControlClient(control_handle),
            ts=TrajectoryServerClient(ts_handle),
            pusher=self._pusher,
            consume_timeout_s=spec.consume_timeout_s,
            on_step=self._maybe_checkpoint,
        )
        self._spec = spec

    def _maybe_checkpoint(self, report: StepReport) -> None:
        every, folder = self._spec.checkpoint_every, self._spec.checkpoint_dir
        step = report.version + 1
        if every > 0 and folder and step % every == 0:
            self.save_checkpoint(os.path.join(folder, f"step-{step}"))

    def run(self, steps: int) -> list[StepReport]:
        return self._loop.run(steps)

    def save_checkpoint(self, path: str) -> str:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per shard garbles the driver's display
        self.trainer.save_checkpoint(path)
        return path

    def stop(self) -> None:
        self._pusher.close(timeout=30)


class ControlActor:
    """Runs with several threads: ``consume`` blocks one of them until the buffer is
    Ready while ``rewarded`` calls keep arriving on the others."""

    def __init__(self, config: Any, ts_handle: Any, ps_endpoint: Any, transport: str) -> None:
        from parameter_server.transport import connect
        from trajectory_server.actor import TrajectoryServerClient

        self._config = config
        self._ts = TrajectoryServerClient(ts_handle)
        self._ps = connect(ps_endpoint, transport)
        self._plane: Any = None

    def attach(self, instance_handles: Mapping[int, Any]) -> None:
        from staleflow.runtime.control import ControlPlane

        ray = _ray()
        clients = {i: InstanceClient(h) for i, h in instance_handles.items()}
        pool = ThreadPoolExecutor(max(4, len(clients)), thread_name_prefix="commands")
        handles = dict(instance_handles)

        def gather() -> list[InstanceSnapshot]:
            return ray.get([h.snapshot.remote() for h in handles.values()])

        self._plane = ControlPlane(
            self._config,
            ts=self._ts,
            instances=clients,
            ps_version=lambda: self._ps.info().latest or 0,
            gather=gather,
            run_round=lambda actions: list(pool.map(lambda a: a(), actions)),
        )
        self._plane.start()

    def rewarded(self, records: list[Rewarded]) -> None:
        self._plane.rewarded(records)

    def consume(self, version: int, timeout_s: float | None) -> ConsumedBatch:
        return self._plane.consume(version, timeout_s)

    def dropped(self, trajectories: list[AbortedTrajectory]) -> None:
        self._plane.dropped(trajectories)

    def trained(self, report: StepReport) -> None:
        self._plane.trained(report)

    def records(self, since: int = 0) -> list[dict[str, float]]:
        return self._plane.records(since)

    def live(self) -> Any:
        return self._plane.live()

    def staleness(self) -> dict[int, int]:
        return dict(self._plane.staleness_of_consumed())

    def stop(self) -> None:
        if self._plane is not None:
            self._plane.stop()
