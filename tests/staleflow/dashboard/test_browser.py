"""Headless Chromium (Debian's ``chromium``) loads the page of a running simulated job,
waits for live data, checks that buffers and instances are drawn with the counts the API
reports, and saves a screenshot in the test's tmp folder.

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
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from staleflow.dashboard.app import create_app
from staleflow.dashboard.server import serve_in_thread
from staleflow.dashboard.sim_source import SimSource
from staleflow.sim import tiny

pytestmark = pytest.mark.browser

ETA = 1
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


@pytest.fixture
def served():
    source = SimSource(tiny(eta=ETA, steps=1000), speed=20.0).start()
    server = serve_in_thread(create_app(source), "127.0.0.1", 0)
    yield server.url
    server.stop()
    source.close()


def _api(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.load(r)


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
    return {
        "buffers": len(re.findall(r"data-buffer=", dom)),
        "slots": len(re.findall(r"data-slot=", dom)),
        "instances": len(re.findall(r"<tr data-instance=", dom)),
        "filled": len(re.findall(r'data-kind="(?:occupied|reserved)"', dom)),
        "updates": int(updates.group(1)) if updates else 0,
    }
