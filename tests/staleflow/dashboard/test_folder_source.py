"""A run folder as a source: read while being written, derived load and markers, and the
API over it (no live buffers: said, not invented)."""

from __future__ import annotations

import json

import pytest

from coordinator.cost_model import learned_speculation
from staleflow.config import RunConfig, load_config, save_config
from staleflow.dashboard.folder_source import FolderError, FolderSource
from tests.staleflow.dashboard.fakes import INSTANCES, flat_record


def _folder(tmp_path, steps: int = 3, *, summary: bool = False):
    run = tmp_path / "20250101-000000-eta2"
    run.mkdir()
    save_config(RunConfig(eta=2, batch_size=4, group_size=2), run / "config.yaml")
    with (run / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps(flat_record(s)) + "\n")
    if summary:
        (run / "summary.json").write_text(json.dumps({"steps": steps, "tokens_per_s": 1.0}))
    return run


def test_reads_records_config_and_cost_model(tmp_path):
    src = FolderSource(_folder(tmp_path))
    info = src.info()
    assert info.kind == "folder" and info.eta == 2 and info.batch_size == 4
    assert info.instances == 2  # rollout.instances of the config
    assert info.cost_model is not None and info.cost_model.kv_budget == 16384
    page = src.records(0, 10)
    assert page.total == 3 and page.items[2].step == 3
    live = src.live()
    assert live.buffers is None and live.ts is None and not live.finished
    assert live.steps == 3 and live.ps_version == 3 and live.elapsed_s == 6.0
    assert [d.version for d in live.instances] == [2] * INSTANCES  # from the last record


def test_the_cost_model_knows_speculation_as_the_coordinator_does(tmp_path):
    """With rollout.speculation on, the estimates use the coordinator's profile: the
    prior before the engines counted 64 verifications, then the acceptance they count."""
    run = tmp_path / "20250101-000000-eta2"
    run.mkdir()
    cfg = load_config(None, ["eta=2", "rollout.speculation.method=group"])
    save_config(cfg, run / "config.yaml")
    prior = cfg.rollout.speculation.profile()
    assert prior is not None
    with (run / "metrics.jsonl").open("w") as f:
        f.write(json.dumps(flat_record(1)) + "\n")  # 4 verifications: the prior still
    src = FolderSource(run, refresh_s=0.0)
    assert src.info().cost_model.speculation == prior
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(flat_record(20)) + "\n")  # 80 verifications, 2.5 accepted each
    learned = src.info().cost_model.speculation
    assert learned == learned_speculation(prior, 80, 400, 200) and learned != prior
    (tmp_path / "off").mkdir()
    plain = FolderSource(_folder(tmp_path / "off"))  # speculation off: no profile
    assert plain.info().cost_model.speculation is None


def test_markers_and_load_come_from_consecutive_records(tmp_path):
    src = FolderSource(_folder(tmp_path))
    events = src.events(0, 100).items
    pulls = [e for e in events if e.kind == "pull"]
    assert [(e.time, e.version) for e in pulls if e.inst == 0] == [(4.0, 1), (6.0, 2)]
    assert [e.version for e in events if e.kind == "push"] == [2, 3]
    assert [e.version for e in events if e.kind == "step"] == [1, 2, 3]
    load = src.load(0, 100).items
    assert len(load) == 3 * INSTANCES and all(s.running is None for s in load)
    # constant cumulative idle ratio r: every step is idle a share r of its time
    assert [round(s.busy_ratio, 6) for s in load if s.inst == 1] == [0.9, 0.9, 0.9]


def test_follows_a_file_being_written(tmp_path):
    run = _folder(tmp_path, steps=1)
    src = FolderSource(run, refresh_s=0.0)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(flat_record(2)) + "\n")
        f.write("{not json}\n")
        f.write(json.dumps(flat_record(3))[:20])  # the writer is mid-line
    assert src.records(0, 10).total == 2
    assert any("unreadable" in n for n in src.info().notes)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(flat_record(3))[20:] + "\n")
    assert src.records(0, 10).total == 3
    (run / "summary.json").write_text("{}")
    assert src.live().finished


def test_bad_folders_are_clear_errors(tmp_path):
    with pytest.raises(FolderError, match="not a folder"):
        FolderSource(tmp_path / "missing")
    with pytest.raises(FolderError, match=r"metrics.jsonl nor config.yaml"):
        FolderSource(tmp_path)
    run = _folder(tmp_path, steps=1)
    (run / "config.yaml").write_text("eta: [unclosed")
    src = FolderSource(run)
    assert src.info().cost_model is None and src.info().eta is None
    assert any("config.yaml" in n for n in src.info().notes)


def test_the_api_over_a_folder(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from staleflow.dashboard.app import create_app

    client = TestClient(create_app(FolderSource(_folder(tmp_path, summary=True))))
    run = client.get("/api/run").json()
    assert run["kind"] == "folder" and run["finished"] and run["steps"] == 3
    buffers = client.get("/api/buffers").json()
    assert not buffers["available"] and buffers["buffers"] == [] and buffers["notes"]
    assert not client.get("/api/ts").json()["available"]
    insts = client.get("/api/instances").json()["instances"]
    assert [d["model_version"] for d in insts] == [2, 2, 2] and insts[0]["running"] is None
    assert client.get("/api/staleness").json()["buffers"][0]["hist"] == {"0": 3, "1": 1}
    assert "staleflow_steps 3" in client.get("/metrics").text
    r = client.post("/api/actions/pause")
    assert r.status_code == 403


def test_a_step_or_version_that_is_not_finite_skips_the_line_not_the_server(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from staleflow.dashboard.app import create_app

    run = _folder(tmp_path, steps=1)
    damaged = [
        {**flat_record(2), "rollout/version/1": float("nan")},
        {**flat_record(2), "ps/version": float("inf")},
        {**flat_record(2), "staleness/hist/0": float("nan")},
        {**flat_record(2), "step": float("nan")},
    ]
    with (run / "metrics.jsonl").open("a") as f:
        for rec in damaged:
            f.write(json.dumps(rec) + "\n")  # json writes NaN and Infinity as such
        f.write(json.dumps({**flat_record(2), "rollout/reward_mean": float("nan")}) + "\n")
    src = FolderSource(run)
    assert src.records(0, 10).total == 2  # a NaN reward is a value, kept (null in JSON)
    assert any("4 unreadable lines" in n for n in src.info().notes)
    client = TestClient(create_app(src), raise_server_exceptions=False)
    for path in ("/api/overview", "/api/metrics", "/api/staleness", "/api/load", "/metrics"):
        assert client.get(path).status_code == 200, path
    assert client.get("/api/metrics").json()["records"][1]["rollout/reward_mean"] is None
