"""Each tracker for real, offline: step records, the config and the summary written
through :func:`staleflow.tracking.open_trackers`, then read back with the library's own
reader (TensorBoard's EventAccumulator, W&B's protocol buffers, MLflow's client)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from staleflow.config import ConfigError, load_config
from staleflow.runfolder.step_record import StepRecord
from staleflow.tracking import DIR, TrackerError, Trackers, open_trackers, parse_trackers
from tests.staleflow.tracking import wandb_records

CONFIG = {"eta": 2, "steps": 3, "trainer": {"lr": 0.001, "backend": "embedded"}, "name": ""}
# integer keys, as summary.json's histograms have them
SUMMARY = {
    "steps": 3,
    "reward_end": 0.5,
    "stopped": False,
    "audit": {"consumed": 24},
    "staleness_hist": {0: 12, 1: 12},
}


def _records() -> list[StepRecord]:
    return [
        StepRecord(
            step=s,
            version=s - 1,
            elapsed_s=1.5 * s,
            reward_mean=0.1 * s,
            tokens=100 + s,
            staleness={0: 4, 1: 4 * s},
            # rollout/idle_ratio (the mean) beside rollout/idle_ratio/<instance>: a key
            # that is another key's folder
            instance_idle={0: 0.1 * s, 1: 0.2},
        )
        for s in (1, 2, 3)
    ]


def _log(trackers: Trackers, records: list[StepRecord]) -> None:
    trackers.log_config(CONFIG)
    for rec in records:
        trackers.log_step(rec.step, rec.to_flat())
    trackers.log_summary(SUMMARY)
    trackers.close()


def test_tensorboard_events_hold_every_step_the_config_and_the_summary(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _records()
    _log(open_trackers(["tensorboard"], tmp_path, "r1", "p"), records)
    events = EventAccumulator(str(tmp_path / DIR / "tensorboard"))
    events.Reload()
    keys = ("rollout/reward_mean", "train/tokens", "staleness/hist/1", "rollout/idle_ratio/0")
    for key in (*keys, "rollout/idle_ratio"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [r.step for r in records]
        assert [e.value for e in scalars] == pytest.approx([r.to_flat()[key] for r in records])
    assert [e.value for e in events.Scalars("summary/audit/consumed")] == [24.0]
    assert [e.step for e in events.Scalars("summary/reward_end")] == [3]  # at the last step
    texts = {tag: events.Tensors(tag)[0] for tag in events.Tags()["tensors"]}
    config_text = texts["config/text_summary"].tensor_proto.string_val[0].decode()
    assert json.loads(config_text.strip("`\n")) == CONFIG


def test_wandb_offline_run_holds_every_step_the_config_and_the_summary(tmp_path):
    pytest.importorskip("wandb")
    records = _records()
    _log(open_trackers(["wandb"], tmp_path, "r1", "my-project"), records)
    path = wandb_records.run_file(tmp_path / DIR / "wandb")
    run = wandb_records.run_record(path)
    assert (run.display_name, run.project) == ("r1", "my-project")
    history = wandb_records.history(path)
    assert [h["_step"] for h in history] == [1, 2, 3]
    for h, rec in zip(history, records, strict=True):
        flat = rec.to_flat()
        assert {k: h[k] for k in flat} == pytest.approx(flat)
    config = wandb_records.config(path)
    assert {k: config[k] for k in CONFIG} == CONFIG
    summary = wandb_records.summary(path)
    assert summary["steps"] == 3 and summary["audit"] == {"consumed": 24}
    assert summary["staleness_hist"] == {"0": 12, "1": 12}  # JSON's keys


def test_mlflow_file_store_holds_every_step_the_config_and_the_summary(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # what the tracker sets for its file store (MLflow 3 refuses one otherwise)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    records = _records()
    trackers = open_trackers(["mlflow"], tmp_path, "r1", "my-experiment")
    (tracker,) = trackers._trackers
    _log(trackers, records)
    client = MlflowClient(tracking_uri=(tmp_path / DIR / "mlruns").as_uri())
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "my-experiment"
    for key in ("rollout/reward_mean", "rollout/idle_ratio", "rollout/idle_ratio/0"):
        # '/' is '.' in MLflow's names: its file store cannot hold a key that is a folder
        history = client.get_metric_history(tracker.run_id, key.replace("/", "."))
        assert [m.step for m in history] == [r.step for r in records]
        assert [m.value for m in history] == pytest.approx([r.to_flat()[key] for r in records])
    assert run.data.params["trainer.lr"] == "0.001" and run.data.params["eta"] == "2"
    assert run.data.metrics["summary.audit.consumed"] == 24.0
    local = client.download_artifacts(tracker.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(local).read_text())["staleness_hist"] == {"0": 12, "1": 12}


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def log_config(self, config):
        pass

    def log_step(self, step, metrics):
        raise RuntimeError("disk full")

    def log_summary(self, summary):
        raise AssertionError("a dropped tracker is called no more")

    def close(self, *, failed):
        self.closed.append(failed)


class _Kept(_Broken):
    name = "kept"

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []
        self.summaries: list[dict] = []

    def log_step(self, step, metrics):
        self.steps.append(step)

    def log_summary(self, summary):
        self.summaries.append(dict(summary))


def test_a_tracker_that_fails_is_dropped_and_the_others_go_on(caplog):
    broken, kept = _Broken(), _Kept()
    trackers = Trackers([broken, kept])
    _log(trackers, _records())
    assert broken.closed == [True]  # closed as failed when it raised, then never called
    assert kept.steps == [1, 2, 3] and kept.summaries == [SUMMARY] and kept.closed == [False]
    assert "the broken tracker failed in log_step and is dropped" in caplog.text


def test_tracker_names_are_parsed_and_an_unknown_one_is_refused_by_the_config():
    assert parse_trackers(" TensorBoard, wandb ,mlflow,wandb") == ("tensorboard", "wandb", "mlflow")
    assert parse_trackers("") == parse_trackers("none") == ()
    with pytest.raises(TrackerError, match=r"'neptune' is not a tracker; use .*tensorboard"):
        parse_trackers("wandb,neptune")
    with pytest.raises(ConfigError, match="tracking='tb'"):
        load_config(None, ["tracking=tb"])
    assert load_config(None, ["tracking=tensorboard,wandb,mlflow"]).tracking


# each tracker missing, listed after one that is installed
@pytest.mark.parametrize(
    ("name", "package", "others"),
    [
        ("wandb", "wandb", "tensorboard"),
        ("mlflow", "mlflow-skinny", "tensorboard"),
        ("tensorboard", "tensorboard", "mlflow"),
    ],
)
def test_a_tracker_not_installed_is_refused_before_anything_starts(
    tmp_path, monkeypatch, name, package, others
):
    import importlib.util

    from staleflow.runtime.driver import launch as driver
    from staleflow.runtime.errors import LaunchError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a)
    )

    def no_cluster(*args, **kwargs):
        raise AssertionError("the launch went on to join a cluster")

    monkeypatch.setattr(driver, "place", no_cluster)
    cfg = load_config(None, [f"tracking={others},{name}", f"run_dir={tmp_path}"])
    with pytest.raises(LaunchError) as err:
        driver.launch(cfg)
    message = str(err.value)
    assert message.startswith(f"tracking={name}: {package} (the {name} tracker) is missing")
    assert "-m pip install" in message and f"[{name}]" in message  # the extra that adds it
    assert f"pip install {package}" in message
    assert not any(tmp_path.iterdir())  # no run folder


def test_a_tracker_that_cannot_start_closes_the_others_and_stops_the_launch(tmp_path, monkeypatch):
    import staleflow.tracking as tracking
    from staleflow.runtime.driver import launch as driver
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.errors import LaunchError

    started = _Kept()

    def fake_open(name, root, run_name, project):
        if name == "mlflow":
            raise RuntimeError("no space left")
        return started

    monkeypatch.setattr(tracking, "_open", fake_open)
    cfg = load_config(None, ["tracking=wandb,mlflow"])
    with pytest.raises(
        LaunchError, match=r"the trackers \(wandb,mlflow\) could not start: no space"
    ):
        driver._start_trackers(plan_run(cfg), tmp_path, {})
    assert started.closed == [True]  # the one that had started is closed, as failed
