"""Placing a run on its Ray cluster, in the driver before anything slow: join (or start)
the cluster, fit the placement plan to its nodes, and print both; a plan the cluster cannot
hold is refused here, naming what is missing (``docs/cluster.md``).

``staleflow launch`` and ``staleflow launch --check`` call :func:`place` first; a
:class:`~staleflow.runtime.driver.run.Run` built without a cluster places itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from staleflow.runtime.placement.fitting import Placement, fit
from staleflow.runtime.placement.plan import PlacementRequest
from staleflow.runtime.placement.ray_cluster import RayCluster, local_cpus, worker_niceness

logger = logging.getLogger(__name__)

Phase = Callable[[str], None]


def log_phase(text: str) -> None:
    """The default for a phase line: the log (the CLI passes its terminal view)."""
    logger.info("%s", text)


def place(request: PlacementRequest, phase: Phase = log_phase) -> tuple[RayCluster, Placement]:
    """Join (or start) the Ray cluster of ``request`` and fit its placement plan to the
    nodes; print both. Raises :class:`LaunchError` when the address does not answer and
    :class:`PlacementError` naming what is missing when the cluster cannot hold the plan."""
    plan = request.plan
    cpus = local_cpus(plan.totals().get("CPU", 0.0) + request.spare_cpus)
    cluster = RayCluster.connect(request.address, cpus)
    try:
        if request.address:
            _warn_niceness(cluster, phase)
        phase(f"placement plan (resources per member; docs/cluster.md), Ray at {cluster.address}:")
        for line in plan.describe():
            phase(f"  {line}")
        placement = fit(plan, cluster.nodes())
    except BaseException:
        cluster.shutdown()
        raise
    phase(f"placed on {len(placement.nodes)} node(s):")
    for line in placement.describe():
        phase(f"  {line}")
    return cluster, placement


def _warn_niceness(cluster: RayCluster, phase: Phase) -> None:
    """A joined cluster whose Ray starts workers niced (its default, 15) runs every actor
    of the run behind any other process on its nodes: say so, and how to change it."""
    try:
        nice = worker_niceness(cluster.ray)
    except Exception as exc:  # a warning only: never stop a launch for it
        logger.debug("could not ask the cluster's worker niceness: %s", exc)
        return
    if nice > 0:
        phase(
            f"warning: this Ray cluster runs worker processes at nice {nice}: every actor of "
            "the run yields the CPU to any other process on its nodes. Start Ray with "
            "RAY_worker_niceness=0 in the environment of `ray start` (deploy/ does)"
        )
