"""Weights & Biases: an offline run in ``<run>/tracking/wandb/`` (no network, no
account); ``wandb sync <that folder>/offline-run-*`` uploads it later. ``WANDB_MODE=online``
in the environment logs to the service directly instead. The step records are the run's
history (``step`` = the training step), the configuration its config, the summary its
summary."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DIR = "wandb"  # wandb writes <dir>/wandb/offline-run-<time>-<id>/


def plain(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` as JSON has it: wandb's summary encoder joins key paths as strings and
    fails on the summary's integer keys (``staleness_hist``: {0: n, ...})."""
    return json.loads(json.dumps(tree, default=str))


class WandbTracker:
    name = "wandb"

    def __init__(self, root: Path, run_name: str, project: str) -> None:
        import wandb

        self.path = root / DIR
        self._wandb = wandb
        root.mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE", "offline")
        self._run = wandb.init(
            project=project,
            name=run_name,
            dir=str(root),
            mode=mode if mode in ("online", "offline", "disabled") else "offline",
            reinit="create_new",  # a second launch in one process starts its own run
            settings=wandb.Settings(
                # console="off": the launch's terminal display is not wrapped or copied
                console="off",
                silent=True,
                # the machine's CPU/GPU sampling is Ray's and the dashboard's job here
                x_disable_stats=True,
            ),
        )

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(plain(config), allow_val_change=True)

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._run.summary.update(plain(summary))

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
        # finish() returns before wandb's core process has written the run's records to
        # its .wandb file (seen with 0.31: a file of its 7-byte header alone, read right
        # after); teardown waits for the core to exit, so the run folder is complete when
        # the launch ends. The driver holds no other W&B run for it to end.
        self._wandb.teardown()
