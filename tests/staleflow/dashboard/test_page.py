"""The single page and its files are served by the app, with nothing fetched elsewhere."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from staleflow.dashboard.app import create_app
from tests.staleflow.dashboard.fakes import FakeSource


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(FakeSource()))


def test_the_page_links_its_own_script_and_style(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert '<script src="static/app.js">' in html
    assert '<link rel="stylesheet" href="static/style.css">' in html
    for element in (
        "buffers",
        "instances",
        "load-chart",
        "staleness-chart",
        "freshness-chart",
        "throughput-chart",
        "eval-chart",
        "episodes-chart",
        "tool-wait-chart",
    ):
        assert f'id="{element}"' in html
    # no CDN: every src/href is relative to the app (or a data: URI)
    for url in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert not url.startswith(("http:", "https:", "//")), url


def test_script_and_style_are_served(client):
    js = client.get("/static/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    for api in ("api/overview", "api/metrics?since=", "api/load?since=", "api/events?since="):
        assert api in js.text
    for attribute in ("data-buffer", "data-slot", "data-instance"):
        assert attribute in js.text
    css = client.get("/static/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert ".buffer-row" in css.text


def test_the_evaluation_chart_reads_the_records_evaluation_keys(client):
    """The chart of the held-out evaluation draws the step record's own keys (spelled in
    the record alone, staleflow/runfolder/step_record.py), one series each."""
    from staleflow.runfolder.step_record import StepRecord, record_key

    html = client.get("/").text
    assert '<canvas id="eval-chart" data-chart="eval"' in html
    js = client.get("/static/app.js").text
    declared = re.search(r"const EVAL_SERIES = \[(.*?)\];", js, re.S)
    assert declared, "app.js declares no EVAL_SERIES"
    keys = re.findall(r'key: "([^"]+)"', declared.group(1))
    rec = StepRecord(step=5, version=4, elapsed_s=1.0, eval_mean_at_k=0.5, eval_pass_at_k=0.75)
    assert keys == ["eval/mean_at_k", "eval/pass_at_k"]
    assert all(record_key(k) and k in rec.to_flat() for k in keys)
    assert 'drawEval($("eval-chart"))' in js


def _declared(js: str, name: str) -> list[dict[str, str]]:
    found = re.search(rf"const {name} = \[(.*?)\];", js, re.S)
    assert found, f"app.js declares no {name}"
    return [
        dict(re.findall(r'(\w+): "([^"]+)"', item))
        for item in re.findall(r"\{(.*?)\}", found.group(1))
    ]


def test_the_episode_charts_draw_every_env_key_of_the_step_record(client):
    """The multi-turn charts (turns, tool calls, errors, tool wait) are declared from the
    step record's own keys, and every env/* key the record has is drawn; a per-episode
    series divides by the record's count of episodes rewarded."""
    from dataclasses import fields

    from staleflow.runfolder.step_record import StepRecord, record_key

    html = client.get("/").text
    assert '<canvas id="episodes-chart" data-chart="episodes"' in html
    assert '<canvas id="tool-wait-chart" data-chart="tool-wait"' in html
    js = client.get("/static/app.js").text
    episodes, waits = _declared(js, "EPISODE_SERIES"), _declared(js, "TOOL_WAIT_SERIES")
    assert [s["label"] for s in episodes] == ["model turns", "tool calls", "environment errors"]
    rec = StepRecord(
        step=3, version=2, elapsed_s=1.0, rewarded=8,
        turns_mean=1.5, tool_calls=6, env_errors=1, tool_wait_s=2.5,
    )  # fmt: skip
    flat = rec.to_flat()
    used = {s["key"] for s in episodes + waits} | {s["per"] for s in episodes + waits if "per" in s}
    assert all(record_key(k) and k in flat for k in used), used
    env_keys = {
        f.metadata["key"]
        for f in fields(StepRecord)
        if f.metadata.get("key", "").startswith("env/")
    }
    assert env_keys == {s["key"] for s in episodes + waits}, "an env/* key without a chart"
    # sums become per-episode values; the turns are a mean already
    per = {s["key"]: s.get("per") for s in episodes}
    assert per == {
        "env/turns_mean": None,
        "env/tool_calls": "rollout/rewarded",
        "env/errors": "rollout/rewarded",
    }
    assert [s.get("per") for s in waits] == [None, "rollout/rewarded"]
    assert 'drawSeries($("episodes-chart"), EPISODE_SERIES' in js
    assert 'drawSeries($("tool-wait-chart"), TOOL_WAIT_SERIES' in js


def test_the_speculation_chart_draws_the_records_speculation_keys(client):
    """Speculative decoding's chart: accepted and rejected draft tokens per verification,
    from the keys the control plane writes (spelled in the step record alone)."""
    from staleflow.runfolder.step_record import speculation_keys

    html = client.get("/").text
    assert '<canvas id="speculation-chart" data-chart="speculation"' in html
    js = client.get("/static/app.js").text
    series = _declared(js, "SPECULATION_SERIES")
    keys = speculation_keys(verifications=4, drafted=10, accepted=6)
    assert [(s["key"], s["per"]) for s in series] == [
        ("speculation/accepted", "speculation/verifications"),
        ("speculation/wasted", "speculation/verifications"),
    ]
    assert all(s["key"] in keys and s["per"] in keys for s in series)
    assert 'drawSeries($("speculation-chart"), SPECULATION_SERIES' in js
