"""TensorBoard: event files in ``<run>/tracking/tensorboard``, written by PyTorch's
``SummaryWriter`` (which needs the ``tensorboard`` package); ``tensorboard --logdir
runs/`` shows every run. Each step record key is a scalar tag (``rollout/reward_mean``);
the configuration and the summary are text (JSON), and the summary's numbers scalars
under ``summary/`` at the last step."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from staleflow.tracking.base import numbers

DIR = "tensorboard"


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, root: Path, run_name: str) -> None:
        # torch's writer: torch is a dependency already; it imports tensorboard itself
        from torch.utils.tensorboard import SummaryWriter

        self.path = root / DIR
        self._writer = SummaryWriter(log_dir=str(self.path))
        self._run_name = run_name
        self._last_step = 0

    def log_config(self, config: Mapping[str, Any]) -> None:
        # a fenced block: TensorBoard renders text as Markdown
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        self._writer.add_text("config", f"```\n{text}\n```", global_step=0)
        self._writer.flush()

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._last_step = step
        self._writer.flush()  # a run followed live shows each step as it comes

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        text = json.dumps(summary, indent=2, sort_keys=True, default=str)
        self._writer.add_text("summary", f"```\n{text}\n```", global_step=self._last_step)
        for key, value in numbers(summary).items():
            self._writer.add_scalar(f"summary/{key}", value, global_step=self._last_step)
        self._writer.flush()

    def close(self, *, failed: bool) -> None:
        self._writer.close()
