"""``staleflow scale``: ask a running run for more or fewer rollout instances.

The request goes to the run's control actor (found by its Ray name); the run's
supervisor carries it out at its next look (``staleflow.runtime.driver.supervisor``): a new
instance Pulls the current version and is routed to at the next cycle, a removed one is
interrupted first so that its partial responses go back to the TS whole.
"""

from __future__ import annotations

import logging
from pathlib import Path

from staleflow.runfolder.layout import LIVE, RunLayout
from staleflow.runtime.controller.clients import ScalingControl
from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE, actor_name

__all__ = ["LIVE", "ScaleError", "find_run", "request_scale"]


class ScaleError(RuntimeError):
    """The request could not be made; the message says why."""


def find_run(run: str, address: str | None) -> tuple[str, str]:
    """(Ray address, run name) of ``run``: a run folder with a ``live.json``, or a run
    name on the cluster at ``address``."""
    folder = Path(run).expanduser()
    layout = RunLayout(folder)
    if layout.live.is_file():
        info = layout.read_live()
        return address or str(info["ray_address"]), str(info["run"])
    if folder.is_dir():
        raise ScaleError(
            f"{folder} has no {LIVE}: the run is not running (staleflow launch writes it "
            "while the run is up)"
        )
    if not address:
        raise ScaleError(
            f"{run!r} is not a run folder: give the folder of a running run, or its name "
            "with --address"
        )
    return address, run


def request_scale(
    run: str,
    address: str | None = None,
    instances: int | None = None,
    add: int | None = None,
    remove: int | None = None,
) -> str:
    """Ask the run for ``instances`` rollout instances (or ``add`` / ``remove`` some);
    returns what the run answered."""
    address, name = find_run(run, address)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address=address,
            namespace=ACTOR_NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    try:
        try:
            control = ScalingControl(
                ray.get_actor(actor_name(name, "control"), namespace=ACTOR_NAMESPACE), ray
            )
        except ValueError:
            raise ScaleError(f"no running run {name!r} on the Ray cluster at {address}") from None
        now = len(control.members(timeout_s=30))
        target = instances if instances is not None else now + (add or 0) - (remove or 0)
        if target < 1:
            raise ScaleError(f"the run has {now} instance(s): it needs at least 1 (asked {target})")
        try:
            return control.request_scale(target, timeout_s=30)
        except ray.exceptions.RayTaskError as exc:
            raise ScaleError(str(exc.cause)) from exc
    finally:
        if started:
            ray.shutdown()
