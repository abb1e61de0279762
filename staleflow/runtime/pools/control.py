"""The control pool: the trajectory server and the control actor (staleness manager and
coordinator on one loop), both on one node (they talk on every cycle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from staleflow.runtime.actors import ControlActor, process_env
from staleflow.runtime.pools import PoolContext

if TYPE_CHECKING:
    from staleflow.data import PromptSampler
    from staleflow.runtime.control import ControlConfig
    from trajectory_server import TrajectoryServerConfig
    from trajectory_server.actor import TrajectoryServerClient


@dataclass(frozen=True)
class ControlPool:
    control: Any  # ControlActor handle
    ts: TrajectoryServerClient


def build_control(
    ctx: PoolContext,
    config: ControlConfig,
    ts_config: TrajectoryServerConfig,
    sampler: PromptSampler,
) -> ControlPool:
    from trajectory_server.actor import spawn_trajectory_server

    ts = spawn_trajectory_server(ts_config, sampler, **ctx.options("ts", process_env(1)))
    # several threads: consume() blocks one until its buffer is Ready
    control = ctx.spawn(ControlActor, "control", process_env(1), max_concurrency=16).remote(
        config, ts.handle
    )
    return ControlPool(control, ts)
