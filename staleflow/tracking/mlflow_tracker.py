"""MLflow: a run in the local file store ``<run>/tracking/mlruns`` (``mlflow ui
--backend-store-uri <that folder>`` shows it), or on the tracking server that
``MLFLOW_TRACKING_URI`` names when it is set. The step records are metrics (``step`` =
the training step), the configuration parameters (dotted keys), the summary an artifact
``summary.json`` with its numbers as ``summary.*`` metrics. Only ``MlflowClient`` is
used: no process-wide active run.

Metric names are the step record's keys with ``.`` for ``/`` (``rollout.reward_mean``):
the file store keeps each metric in a file at its name's path, and the record has keys
that are another key's folder (``rollout/idle_ratio``, the mean, beside
``rollout/idle_ratio/0``, one instance's), which it cannot hold.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from staleflow.runfolder.layout import SUMMARY
from staleflow.tracking.base import flatten, numbers

DIR = "mlruns"
# MLflow's own limits on one log_batch call and on a parameter's value
_MAX_METRICS, _MAX_PARAMS, _MAX_VALUE = 1000, 100, 6000


def store_uri(root: Path) -> str:
    """Where the run goes: ``MLFLOW_TRACKING_URI``, else the file store in the run folder."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (root / DIR).resolve().as_uri()


def metric_name(key: str) -> str:
    """The MLflow metric of a step record key (see the module docstring)."""
    return key.replace("/", ".")


class MlflowTracker:
    name = "mlflow"

    def __init__(self, root: Path, run_name: str, experiment: str) -> None:
        self.uri = store_uri(root)
        if self.uri.startswith("file:"):
            # MLflow 3 refuses its file store unless this is set (it wants a database);
            # a store with no server and no database is what a run folder can hold
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            # and a local run sends nothing anywhere: no usage telemetry to MLflow's
            # servers (set before the import, which may start its client)
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self._client = MlflowClient(tracking_uri=self.uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id if found is not None else self._client.create_experiment(experiment)
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self._last_step = 0

    def _metrics(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        items = [self._metric(metric_name(k), float(v), now, step) for k, v in values.items()]
        for i in range(0, len(items), _MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=items[i : i + _MAX_METRICS])

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = [self._param(k, str(v)[:_MAX_VALUE]) for k, v in flatten(config)]
        for i in range(0, len(params), _MAX_PARAMS):
            self._client.log_batch(self.run_id, params=params[i : i + _MAX_PARAMS])

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(step, metrics)
        self._last_step = step

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._client.log_dict(self.run_id, dict(summary), SUMMARY)
        self._metrics(self._last_step, {f"summary/{k}": v for k, v in numbers(summary).items()})

    def close(self, *, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
