"""What ``staleflow launch`` checks of a run plan before it joins a cluster or loads a
model: the backends can build the run (``staleflow.runtime.backends``), the trackers'
libraries are installed, and the files the run reads are there with the columns it
reads. Each refusal is a :class:`LaunchError` naming the key and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from staleflow.config.env import ENV_TASKS
from staleflow.data.hf_datasets import check_columns, data_files, open_hf_dataset
from staleflow.data.layouts import DatasetError
from staleflow.runtime.backends import check_backends
from staleflow.runtime.driver.env_task import check_env_task
from staleflow.runtime.driver.evaluation import check_heldout
from staleflow.runtime.errors import LaunchError
from staleflow.tracking import TrackerError, check_installed, parse_trackers

if TYPE_CHECKING:
    from staleflow.runtime.driver.run_plan import RunPlan


def check_launch(plan: RunPlan) -> None:
    """Everything checkable before a cluster is joined: the backends, then
    :func:`preflight`."""
    check_backends(plan.rollout, plan.trainer, plan.model, plan.recovery, address=plan.address)
    preflight(plan)


def preflight(plan: RunPlan) -> None:
    """Paths the run reads and the trackers' libraries, checked before a cluster is joined
    or a model loaded."""
    try:
        check_installed(parse_trackers(plan.tracking))
    except TrackerError as exc:
        raise LaunchError(str(exc)) from None
    data = plan.task.data  # data.task=hf (and env) reads a save_to_disk folder, or files
    hf_data = data.task in ("hf", "env")
    for key, value, kind, what in (
        ("model.checkpoint", plan.model.checkpoint, "dir", "cannot load the policy"),
        ("data.tokenizer", data.tokenizer, "any", "cannot load the policy"),
        ("data.path", data.path, "any" if hf_data else "file", "cannot read the prompts"),
    ):
        if not value or (hf_data and key == "data.path" and data_files(value)):
            continue
        path = Path(value).expanduser()
        ok = path.is_dir() if kind == "dir" else path.is_file() if kind == "file" else path.exists()
        if not ok:
            thing = {"dir": "checkpoint directory", "file": "file"}.get(kind, "file or directory")
            raise LaunchError(f"{what}: {path}: no such {thing} (set by {key})")
    if data.task in ENV_TASKS:  # the environment builds, its problems read
        check_env_task(plan.task)
    elif hf_data:  # its columns: memory-mapped, read without the policy or its tokenizer
        try:
            check_columns(open_hf_dataset(data.path, data.split), data.record_layout(), data.path)
        except DatasetError as exc:
            raise LaunchError(f"cannot read the prompts: {exc}") from exc
    try:  # eval.path: there, with the columns (one row read)
        check_heldout(plan.task)
    except DatasetError as exc:
        raise LaunchError(f"cannot read the held-out set (eval.path): {exc}") from exc
