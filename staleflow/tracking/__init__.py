"""Experiment trackers: TensorBoard, Weights & Biases (offline) and MLflow (a local file
store), chosen by the ``tracking`` key (several at once: ``tracking=tensorboard,wandb``).

Each writes under ``<run folder>/tracking/`` and receives the resolved configuration, every
step record and the summary (:mod:`staleflow.tracking.base`). The libraries are extras
(``pip install 'staleflow[tracking]'``, or one of ``[tensorboard]``, ``[wandb]``,
``[mlflow]``): :func:`check_installed` refuses a tracker that is not installed before the
launch starts anything, with the command that installs it. Importing this package imports
no tracker library: each backend imports its own when it is built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from staleflow.install import missing
from staleflow.runfolder.layout import TRACKING
from staleflow.tracking.base import Tracker, Trackers, flatten, numbers
from staleflow.tracking.mlflow_tracker import MlflowTracker
from staleflow.tracking.tensorboard_tracker import TensorBoardTracker
from staleflow.tracking.wandb_tracker import WandbTracker

__all__ = [
    "DIR",
    "TRACKERS",
    "Tracker",
    "TrackerError",
    "Trackers",
    "check_installed",
    "flatten",
    "numbers",
    "open_trackers",
    "parse_trackers",
]

DIR = TRACKING  # <run folder>/tracking/<backend's folder>


@dataclass(frozen=True)
class _Backend:
    module: str  # what must be importable
    package: str  # what pip installs
    extra: str  # staleflow's extra that installs it


TRACKERS: dict[str, _Backend] = {
    "tensorboard": _Backend("tensorboard", "tensorboard", "tensorboard"),
    "wandb": _Backend("wandb", "wandb", "wandb"),
    "mlflow": _Backend("mlflow", "mlflow-skinny", "mlflow"),
}


class TrackerError(ValueError):
    """An unknown tracker name, or a tracker whose library is not installed; the message
    says the fix."""


def parse_trackers(spec: str) -> tuple[str, ...]:
    """The tracker names of ``tracking=a,b`` in order, each once; '' or ``none``: none."""
    names: list[str] = []
    for raw in spec.split(","):
        name = raw.strip().lower()
        if name in ("", "none"):
            continue
        if name not in TRACKERS:
            raise TrackerError(
                f"tracking={spec!r}: {name!r} is not a tracker; use a comma-separated list "
                f"of {' | '.join(TRACKERS)} (e.g. tracking=tensorboard,wandb), or '' for none"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def check_installed(names: Sequence[str]) -> None:
    """Refuse trackers whose library cannot be imported, naming the pip command (the
    module is found, not imported: importing wandb or mlflow takes seconds)."""
    for name in names:
        backend = TRACKERS[name]
        if importlib.util.find_spec(backend.module) is None:
            raise TrackerError(
                f"tracking={name}: "
                + missing(f"{backend.package} (the {name} tracker)", extra=backend.extra)
                + f" (or pip install {backend.package}); or drop {name} from tracking"
            )


def open_trackers(names: Sequence[str], run_dir: Path, run_name: str, project: str) -> Trackers:
    """The trackers ``names``, each started in ``run_dir/tracking``; ``project`` names the
    W&B project and the MLflow experiment."""
    root = run_dir / DIR
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_open(name, root, run_name, project))
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    return Trackers(opened)


def _open(name: str, root: Path, run_name: str, project: str) -> Tracker:
    # each backend imports its library when it is built, once the run uses it
    if name == "tensorboard":
        return TensorBoardTracker(root, run_name)
    if name == "wandb":
        return WandbTracker(root, run_name, project)
    if name == "mlflow":
        return MlflowTracker(root, run_name, project)
    raise TrackerError(f"{name!r} is not a tracker; use {' | '.join(TRACKERS)}")
