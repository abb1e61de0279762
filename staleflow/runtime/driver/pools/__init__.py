"""One small builder per pool of a run (Figure 6): each receives its typed section and
the :class:`PoolContext`, and starts its members in the bundles the placement gave them.

================================  ============================================
module                            pool
================================  ============================================
:mod:`.controller`                control plane (staleness manager, coordinator) + TS
:mod:`.parameter_server`          one PS replica per rollout node (App. A.1)
:mod:`.rewards`                   reward workers
:mod:`.rollout`                   rollout instances; engine by ``rollout.backend``
:mod:`.trainer`                   trainer ranks; pool by ``trainer.backend``
================================  ============================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE, actor_name

if TYPE_CHECKING:
    from staleflow.runtime.placement.fitting import Placement
    from staleflow.runtime.placement.ray_cluster import Reservation

Phase = Callable[[str], None]
T = TypeVar("T")
NAME_WAIT_S = 30.0  # a killed actor's Ray name is free once the GCS has seen it die


def respawn(start: Callable[[], T], wait_s: float = NAME_WAIT_S) -> T:
    """``start()`` an actor under the name of one that just died (a restart): Ray
    refuses the name (``ValueError``) until it has seen the old one die, so try again
    for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return start()
        except ValueError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


@dataclass(frozen=True)
class PoolContext:
    """What every pool builder shares: Ray, the run's name, where each member goes."""

    ray: Any  # the ray module
    run: str  # the run folder's name: actors are <run>/<role> in ACTOR_NAMESPACE
    placement: Placement
    reservation: Reservation
    driver_node: str  # the node of this driver process ('' when on none)
    multi_node: bool  # other nodes may need to reach a member over the network
    phase: Phase

    def naming(self, role: str) -> dict[str, str]:
        """Ray name and namespace of ``role``: ``staleflow status`` and ``staleflow
        dashboard --address`` find the run's actors by them from any node."""
        return {"name": actor_name(self.run, role), "namespace": ACTOR_NAMESPACE}

    def options(
        self, role: str, env: Mapping[str, str] | None = None, **extra: object
    ) -> dict[str, Any]:
        """Actor options of ``role``: its bundle, its name, its process environment."""
        gang = self.placement.gang_of(role).gang.name
        out = {**self.reservation.options(gang, role), **self.naming(role), **extra}
        if env:
            out["runtime_env"] = {"env_vars": dict(env)}
        return out

    def spawn(
        self, cls: type, role: str, env: Mapping[str, str] | None = None, **extra: object
    ) -> Any:
        """``ray.remote(cls)`` with :meth:`options`; call ``.remote(...)`` on it."""
        return self.ray.remote(cls).options(**self.options(role, env, **extra))
