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
