"""The Ray cluster of one run: joined (``address``) or started on this machine, its nodes
as :func:`staleflow.runtime.placement.fitting.fit` sees them, and the placement reserved as Ray
placement groups.

Each gang becomes one placement group whose bundles are pinned, through Ray's default
``ray.io/node-id`` node label, to the nodes the fit chose (Ray >= 2.49 labels every node
with its id and recommends this label over ``NodeAffinitySchedulingStrategy``: docs.ray.io
``ray-core/scheduling/labels``). Ray then reserves exactly the placement that was checked
and printed; a group it cannot reserve within ``resources.placement_timeout_s`` (another
job took the room since the check) stops the launch naming it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from staleflow.install import missing
from staleflow.runtime.errors import LaunchError, PlacementError
from staleflow.runtime.placement.fitting import Node, PlacedGang, Placement
from staleflow.runtime.placement.plan import NODE_RESOURCE_SHARE
from staleflow.runtime.placement.ray_address import check_reachable

if TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "staleflow"  # staleflow.dashboard.ray_source finds runs here
NODE_ID_LABEL = "ray.io/node-id"
# Starts of a local Ray before a start-up time-out is the launch's error: Ray's wait is a
# fixed 30 s, which two busy cores can miss once and rarely twice.
LOCAL_START_TRIES = 3


def actor_name(run: str, role: str) -> str:
    """The Ray name of one actor of run ``run`` (the run folder's name)."""
    return f"{run}/{role}"


def import_ray() -> Any:
    """The ``ray`` module, or a LaunchError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise LaunchError(
            missing("ray (staleflow launch runs its components as Ray actors)", exc)
        ) from exc
    return ray


class RayApi(Protocol):
    """What the actors' clients use of the ``ray`` module (unit tests pass a fake)."""

    exceptions: Any  # the module ray.exceptions

    def get(self, refs: object, timeout: float | None = None) -> Any: ...

    def wait(
        self, refs: list[object], num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[object], list[object]]: ...


def startup_error(address: str, exc: BaseException, tries: int = 1) -> str:
    """The one-line reason a Ray start or join failed, with what to do."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = lines[0] if lines else type(exc).__name__
    if address:
        return (
            f"cannot join the Ray cluster at {address}: {why}; start one with "
            "`ray start --head` (deploy/ and docs/cluster.md show how)"
        )
    return (
        f"Ray did not start on this machine: {why}. Nothing of the run was changed: "
        f"{'started ' + str(tries) + ' times; ' if tries > 1 else ''}retry (a loaded machine "
        "can miss Ray's 30 s start-up wait), or start Ray once "
        "with `ray start --head` and launch with address=auto"
    )


def _timed_out(exc: BaseException) -> bool:
    """Whether a failed ``ray.init`` is the raylet missing Ray's fixed 30 s start-up wait
    (``ray/_private/node.py``), which a second start on a loaded machine usually makes."""
    return "timed out during startup" in str(exc)


def _children() -> set[int]:
    try:
        import psutil
    except ImportError:  # ray[default] brings it; without it nothing is cleaned up
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop_started(ray: ModuleType, before: set[int]) -> None:
    """After a failed ``ray.init``: the processes it started (GCS, raylet, agents) are
    owned by a node object Ray never kept, so ``ray.shutdown`` may not reach them;
    terminate this process's children that were not there before it."""
    try:
        ray.shutdown()
    except Exception as exc:
        logger.debug("ray.shutdown after a failed start: %s", exc)
    try:
        import psutil
    except ImportError:
        return
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in new:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(new, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


class RayCluster:
    """A connection to the Ray cluster of a run; :meth:`shutdown` leaves a joined cluster
    running and stops one this process started."""

    def __init__(self, ray: ModuleType, started: bool, address: str) -> None:
        self.ray = ray
        self.started = started
        self.address = address

    @classmethod
    def connect(cls, address: str, local_cpus: float) -> RayCluster:
        """Join ``address`` (``auto``, ``host:port``, ``ray://host:port``), or start a local
        Ray with ``local_cpus`` CPU slots when it is empty. An address where nothing
        answers fails at once, naming it (``ray.init`` would retry for minutes)."""
        ray = import_ray()
        if ray.is_initialized():  # a caller (a test, a notebook) joined one already
            return cls(ray, started=False, address=address or "this process's Ray")
        if address:
            try:
                check_reachable(address)
            except (ConnectionError, ValueError) as exc:
                raise LaunchError(str(exc)) from None
        for attempt in range(1, LOCAL_START_TRIES + 1):
            before = _children()
            try:
                ray.init(**init_kwargs(address, local_cpus))
                break
            except Exception as exc:  # Ray raises a bare Exception when its start-up times out
                _stop_started(ray, before)
                if address or attempt == LOCAL_START_TRIES or not _timed_out(exc):
                    raise LaunchError(startup_error(address, exc, attempt)) from None
                logger.warning(
                    "Ray's local start-up missed its 30 s wait (a loaded machine): "
                    "starting it again (%d of %d)",
                    attempt + 1,
                    LOCAL_START_TRIES,
                )
        return cls(ray, started=True, address=address or "local")

    def driver_node(self) -> str:
        """The node of this driver process ('' for a Ray client, which is on none)."""
        try:
            return self.ray.get_runtime_context().get_node_id()
        except Exception:
            return ""

    def nodes(self) -> list[Node]:
        """The alive nodes, the driver's first, with what is free on each now."""
        ray = self.ray
        try:  # per-node availability; ray.available_resources() only sums them
            from ray._private.state import available_resources_per_node

            free: Mapping[str, Mapping[str, float]] = available_resources_per_node()
        except (ImportError, AttributeError):
            logger.warning("this Ray reports no per-node availability: fitting to totals")
            free = {}
        here = self.driver_node()
        out = []
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            labels = dict(n.get("Labels") or {})
            if NODE_ID_LABEL not in labels:
                raise LaunchError(
                    f"the Ray nodes carry no {NODE_ID_LABEL} label (Ray {ray.__version__}): "
                    "staleflow launch pins its placement groups with it; use Ray >= 2.49"
                )
            node_id = n["NodeID"]
            out.append(
                Node(
                    node_id,
                    n.get("NodeManagerAddress", ""),
                    dict(free.get(node_id, n.get("Resources", {}))),
                    labels,
                )
            )
        out.sort(key=lambda node: node.node_id != here)
        return out

    def reserve(self, placement: Placement, run: str, timeout_s: float) -> Reservation:
        """One placement group per gang, pinned to its nodes; all ready or none kept."""
        from ray.util.placement_group import placement_group

        groups = {}
        for placed in placement.gangs:
            gang = placed.gang
            groups[gang.name] = (
                placement_group(
                    [gang.bundle.resources() for _ in gang.roles],
                    strategy="STRICT_PACK" if len(set(placed.nodes)) == 1 else "PACK",
                    name=f"{run}/{gang.name}",
                    bundle_label_selector=[{NODE_ID_LABEL: node} for node in placed.nodes],
                ),
                placed,
            )
        reservation = Reservation(self.ray, groups)
        ready = {pg.ready(): name for name, (pg, _) in groups.items()}
        done, _ = self.ray.wait(list(ready), num_returns=len(ready), timeout=timeout_s)
        pending = [ready[ref] for ref in ready if ref not in done]
        if pending:
            reservation.remove()
            raise PlacementError(
                [
                    f"Ray did not reserve {name} within resources.placement_timeout_s="
                    f"{timeout_s:g} s (another job may hold its resources since the check)"
                    for name in pending
                ]
            )
        return reservation

    def shutdown(self) -> None:
        if self.started:
            self.ray.shutdown()


def init_kwargs(address: str, local_cpus: float) -> dict[str, Any]:
    """``ray.init`` arguments: join ``address`` when set, else start a local Ray of our
    own: without an address ``ray.init`` would join the last cluster ``ray start`` left on
    this machine (ray 2.60 ``ray.init`` docstring, "local"), where ``num_cpus`` is
    refused and another job's actors share the slots."""
    kwargs: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    if address:
        kwargs["address"] = address
    else:
        kwargs["address"] = "local"
        kwargs["num_cpus"] = local_cpus
        # Ray starts worker processes at nice 15 (its worker_niceness default): every
        # actor of the run, the engines and the trainer included, would yield the CPU to
        # any other process on the machine. Beside two busy loops the embedded rollout
        # ran 25x slower, not 2x. A joined cluster keeps its own setting (deploy/ starts
        # Ray with RAY_worker_niceness=0; launch warns otherwise, worker_niceness()).
        kwargs["_system_config"] = {"worker_niceness": 0}
    return kwargs


def worker_niceness(ray: ModuleType) -> int:
    """The niceness Ray gives worker processes on this cluster (asked of one task)."""

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    return int(ray.get(niceness.remote(), timeout=120))


def local_cpus(plan_cpus: float) -> float:
    """CPU slots of a local Ray: the machine's cores, or what the plan asks if more. The
    embedded actors mostly wait on each other; the slots only gate scheduling."""
    return max(float(os.cpu_count() or 1), 4.0, plan_cpus)


class Reservation:
    """The placement groups of a run, by gang name."""

    def __init__(self, ray: ModuleType, groups: Mapping[str, tuple[Any, PlacedGang]]) -> None:
        self._ray = ray
        self._groups = dict(groups)

    def group(self, gang: str) -> Any:
        """The placement group of ``gang`` (an engine places its TP workers in it)."""
        return self._groups[gang][0]

    def options(self, gang: str, role: str) -> dict[str, Any]:
        """Actor options that put ``role`` into its bundle of ``gang``'s group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, placed = self._groups[gang]
        bundle = placed.gang.bundle
        out: dict[str, Any] = {
            "num_cpus": bundle.cpus,
            "num_gpus": bundle.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=placed.gang.roles.index(role)
            ),
        }
        if bundle.group.resource:
            out["resources"] = {bundle.group.resource: NODE_RESOURCE_SHARE}
        return out

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for name, (pg, _) in self._groups.items():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # the run is ending anyway; say what was left behind
                logger.warning("could not remove placement group %s: %s", name, exc)
        self._groups.clear()
