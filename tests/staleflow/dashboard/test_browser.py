"""Headless Chromium (Debian's ``chromium``) loads the page of a running simulated job,
waits for live data, checks that buffers and instances are drawn with the counts the API
reports, pauses the simulation (the token-guarded action) and checks that the load chart
drew one Pull mark per Pull event of the API and the throughput curve one point per
step record, and saves a screenshot in the test's tmp folder. A second test opens
``/docs`` and ``/redoc`` with every request to another host refused and checks that
Swagger UI and ReDoc still render the API (their files ship in ``fastapi-offline``).

Driven by Playwright with the system browser (``executable_path``: Playwright's own
browser download does not work offline) when the ``playwright`` package is installed;
otherwise by ``chromium --headless --dump-dom`` with a virtual-time budget, which runs the
page's polling for that long before dumping the DOM.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from staleflow.dashboard.app import create_app
from staleflow.dashboard.server import serve_in_thread
from staleflow.dashboard.sim_source import SimSource
from staleflow.sim import tiny

pytestmark = pytest.mark.browser

ETA = 1
TOKEN = "browser-test-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


@pytest.fixture
def served():
    source = SimSource(tiny(eta=ETA, steps=1000), speed=20.0).start()
    server = serve_in_thread(create_app(source, token=TOKEN), "127.0.0.1", 0)
    yield server.url
    server.stop()
    source.close()


def _api(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.load(r)


def _pause(url: str) -> None:
    request = urllib.request.Request(
        url + "api/actions/pause", method="POST", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert json.load(r) == {"action": "pause", "result": "paused"}


def _settled(url: str) -> tuple[int, int, int]:
    """After a pause the simulator finishes at most the cycle it is in: wait until the
    numbers of load samples, events and records stop changing."""
    last = None
    for _ in range(40):
        now = tuple(_api(url, f"api/{p}?limit=1")["total"] for p in ("load", "events", "metrics"))
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError(f"the paused simulation still moves: {last}")


def _api_marks(url: str) -> dict[str, int]:
    """What the page must have drawn, from the API: Pull events of a charted instance at
    or after the first load sample (the chart's left edge), and throughput points."""
    load = _api(url, "api/load?limit=10000")
    assert load["first"] == 0 and load["next"] == load["total"] <= 10_000
    insts = {s["inst"] for s in load["samples"]}
    t0 = load["samples"][0]["time"]
    events = _api(url, "api/events?kind=pull&limit=10000")
    assert events["first"] == 0 and events["next"] == events["total"]
    pulls = events["events"]
    records = _api(url, "api/metrics?prefix=throughput/&limit=10000")
    assert records["next"] == records["total"]
    return {
        "pulls": len(pulls),
        "pull_marks": sum(1 for e in pulls if e["inst"] in insts and e["time"] >= t0),
        "cumulative": sum(1 for r in records["records"] if "throughput/tokens_per_s" in r),
        "per_step": sum(1 for r in records["records"] if "throughput/step_tokens_per_s" in r),
    }


def _expected(url: str) -> tuple[list[int], int]:
    overview = _api(url, "api/overview")
    capacities = [b["capacity"] for b in overview["buffers"]["buffers"]]
    return capacities, len(overview["instances"]["instances"])


def test_page_draws_live_buffers_and_instances(served, tmp_path):
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        counts = _with_chromium_cli(served, tmp_path)
    else:
        counts = _with_playwright(served, tmp_path)
    capacities, instances = _expected(served)
    assert len(capacities) == ETA + 1
    assert counts["buffers"] == ETA + 1
    assert counts["slots"] == sum(capacities)
    assert counts["instances"] == instances == 4
    assert counts["updates"] >= 2
    assert counts["filled"] > 0, "no reserved or occupied slot was drawn"
    assert counts["pull_marks"] > 0, "the load chart drew no Pull mark"
    assert counts["throughput_points"] >= 1, "the throughput curve has no point"
    if "api" in counts:  # Playwright: drawn on a paused run, so exactly what the API has
        api = counts["api"]
        assert counts["pulls"] == api["pulls"]
        assert counts["pull_marks"] == api["pull_marks"] > 0
        assert counts["series"] == [api["cumulative"], api["per_step"]]
        assert api["cumulative"] >= 1
    shot = tmp_path / "dashboard.png"
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def _with_playwright(url: str, tmp_path) -> dict[str, int]:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            # live data: several polls, a finished training step and filled slots
            page.wait_for_function(
                "Number(document.body.dataset.updates || 0) >= 3"
                " && document.querySelectorAll('[data-kind=occupied],[data-kind=reserved]').length"
                " && Number(document.getElementById('staleness-chart').dataset.bars || 0) >= 1",
                timeout=60_000,
            )
            counts = {
                "buffers": page.locator("#buffers [data-buffer]").count(),
                "slots": page.locator("#buffers [data-slot]").count(),
                "instances": page.locator("#instances tr[data-instance]").count(),
                "filled": page.locator("[data-kind=occupied], [data-kind=reserved]").count(),
                "updates": int(page.evaluate("document.body.dataset.updates")),
            }
            assert page.locator("#load-chart").get_attribute("data-instances") == "4"
            assert page.locator("#run-status").get_attribute("data-status") == "running"
            # pause, let the page catch up, then compare what it drew with the API
            _pause(url)
            _settled(url)
            seen = int(page.evaluate("document.body.dataset.updates"))
            page.wait_for_function(
                f"Number(document.body.dataset.updates) >= {seen + 2}", timeout=30_000
            )
            counts["api"] = _api_marks(url)
            load = page.locator("#load-chart")
            counts["pulls"] = int(load.get_attribute("data-pulls"))
            counts["pull_marks"] = int(load.get_attribute("data-pull-marks"))
            throughput = page.locator("#throughput-chart")
            counts["throughput_points"] = int(throughput.get_attribute("data-points"))
            counts["series"] = [
                int(n) for n in throughput.get_attribute("data-series-points").split(",")
            ]
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert errors == [], errors
    return counts


def _with_chromium_cli(url: str, tmp_path) -> dict[str, int]:
    base = [CHROMIUM, "--headless", *FLAGS, "--virtual-time-budget=15000"]
    dom = subprocess.run(
        [*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    subprocess.run(
        [*base, "--window-size=1400,1800", f"--screenshot={tmp_path / 'dashboard.png'}", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    updates = re.search(r'data-updates="(\d+)"', dom)
    marks = re.search(r'<canvas id="load-chart"[^>]*\bdata-pull-marks="(\d+)"', dom)
    points = re.search(r'<canvas id="throughput-chart"[^>]*\bdata-points="(\d+)"', dom)
    return {
        "pull_marks": int(marks.group(1)) if marks else 0,
        "throughput_points": int(points.group(1)) if points else 0,
        "buffers": len(re.findall(r"data-buffer=", dom)),
        "slots": len(re.findall(r"data-slot=", dom)),
        "instances": len(re.findall(r"<tr data-instance=", dom)),
        "filled": len(re.findall(r'data-kind="(?:occupied|reserved)"', dom)),
        "updates": int(updates.group(1)) if updates else 0,
    }


def test_docs_pages_render_with_no_other_host_reachable(served, tmp_path):
    """Swagger UI and ReDoc draw the API's operations while every request to a host other
    than the dashboard's is refused (as on a machine without internet access); none gets
    that far, as the pages' Content-Security-Policy stops them inside the browser."""
    pytest.importorskip("playwright.sync_api")
    from playwright.sync_api import sync_playwright

    host = urlsplit(served).hostname
    spec = _api(served, "openapi.json")
    operations = sum(
        1 for ops in spec["paths"].values() for m in ops if m in ("get", "post", "put", "delete")
    )
    elsewhere: list[str] = []
    errors: list[str] = []
    console: list[str] = []

    def only_here(route):
        if urlsplit(route.request.url).hostname in (host, None) or route.request.url.startswith(
            "data:"
        ):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and console.append(m.text))
            page.route("**/*", only_here)
            page.goto(served)  # the dashboard's footer link leads to /docs
            page.click("footer a[href=docs]")
            page.wait_for_url(served + "docs")
            page.wait_for_selector(".swagger-ui .opblock", timeout=60_000)
            assert page.locator(".swagger-ui .opblock").count() == operations
            assert (
                page.locator(".swagger-ui .info .title")
                .inner_text()
                .startswith("StaleFlow dashboard")
            )
            page.screenshot(path=str(tmp_path / "docs.png"))
            page.goto(served + "redoc")
            page.wait_for_selector("text=Run, buffers, instances, TS and PS", timeout=60_000)
            assert page.locator("h1").first.inner_text().startswith("StaleFlow dashboard")
            page.screenshot(path=str(tmp_path / "redoc.png"))
        finally:
            browser.close()
    assert elsewhere == [], elsewhere
    assert errors == [], errors
    # the pages' Content-Security-Policy refuses one thing: ReDoc's Redocly logo (an
    # image on Redocly's CDN, which ReDoc hides when it does not load)
    refused = [m for m in console if "cdn.redoc.ly/redoc/logo-mini.svg" not in m]
    assert refused == [], refused
    print(f"screenshots: {tmp_path / 'docs.png'} {tmp_path / 'redoc.png'}")
