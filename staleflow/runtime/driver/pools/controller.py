"""The control pool: the trajectory server and the control actor (staleness manager and
coordinator on one loop), both on one node (they talk on every cycle), with the control
actor's clients for the driver's two audiences (the run, the supervisor)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from staleflow.runtime.controller.actor import ControlActor
from staleflow.runtime.controller.clients import DriverControl, SupervisorControl
from staleflow.runtime.driver.pools import PoolContext
from staleflow.runtime.workers.actors import process_env
from trajectory_server.actor import spawn_trajectory_server

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from staleflow.data import PromptSampler
    from staleflow.runtime.controller.plane_records import ControlConfig
    from staleflow.runtime.workers.ps_healing import ReplicaResolver
    from trajectory_server import TrajectoryServerConfig
    from trajectory_server.actor import TrajectoryServerClient


@dataclass(frozen=True)
class ControlPool:
    control: ActorHandle[ControlActor]  # the Ray handle, which the worker actors are given
    ts: TrajectoryServerClient
    driver: DriverControl  # the run's client of it
    supervisor: SupervisorControl  # the supervisor's


def build_control(
    ctx: PoolContext,
    config: ControlConfig,
    ts_config: TrajectoryServerConfig,
    sampler: PromptSampler,
    *,
    ts_state: Mapping[str, object] | None = None,
    resolver: ReplicaResolver | None = None,
    snapshot_timeout_s: float = 60.0,
) -> ControlPool:
    """``ts_state``: a resumed run's trajectories (``sampler`` at the saved position)."""

    ts = spawn_trajectory_server(ts_config, sampler, ts_state, **ctx.options("ts", process_env(1)))
    # several threads: consume() blocks one until its buffer is Ready
    control = ctx.spawn(ControlActor, "control", process_env(1), max_concurrency=16).remote(
        config, ts.handle, resolver, snapshot_timeout_s
    )
    return ControlPool(
        control, ts, DriverControl(control, ctx.ray), SupervisorControl(control, ctx.ray)
    )
