"""``staleflow launch`` with ``dashboard=true`` on real Ray actors: the driver serves the
dashboard and prints its URL, the page's API shows the live run, and the actors are named
so that a second client finds the run (what ``staleflow dashboard --address`` does)."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_port() -> int:
    from staleflow.dashboard.server import bind

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_launch_serves_the_dashboard_of_the_live_run(tmp_path):
    from staleflow.config import load_config
    from staleflow.dashboard.launch_hook import LaunchDashboard
    from staleflow.dashboard.ray_source import RaySource
    from staleflow.runtime.driver.launch import launch

    cfg = load_config(
        None,
        [
            "eta=1",
            "steps=3",
            f"run_dir={tmp_path}",
            "model.preset=micro",
            "model.warmup=false",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=8",
            "coordinator.period_s=0.05",
            "dashboard=true",
            f"dashboard_port={_free_port()}",
        ],
    )
    phases: list[str] = []
    seen: dict = {}

    def on_record(rec: dict) -> None:
        if seen:
            return
        url = next(p.split()[-1] for p in phases if p.startswith("dashboard at "))
        with urllib.request.urlopen(url + "api/overview", timeout=10) as r:
            seen["overview"] = json.load(r)
        seen["phase"] = forwarded[-1]
        attached = RaySource.attach("auto")  # ray is initialised: finds the named actors
        attached.poll_once()
        seen["attached"] = attached.live()
        seen["name"] = attached.name
        attached.close()

    dashboard = LaunchDashboard(cfg, say=phases.append)

    forwarded: list[str] = []

    def on_phase(text: str) -> None:  # what staleflow launch does with its phases
        phases.append(text)
        forwarded.append(text)
        dashboard.phase(text)

    result = launch(cfg, on_record=on_record, on_phase=on_phase, on_started=dashboard)
    assert any(p.startswith("dashboard at http://127.0.0.1:") for p in phases), phases
    overview = seen["overview"]
    assert overview["run"]["kind"] == "live" and overview["buffers"]["available"]
    assert overview["run"]["phase"] == seen["phase"]  # the launcher's latest phase
    assert len(overview["buffers"]["buffers"]) == 2
    assert len(overview["instances"]["instances"]) == 2
    assert overview["ts"]["available"] and overview["ps"]["latest"] is not None
    assert seen["name"] == result.run_dir.name
    assert seen["attached"].buffers is not None and len(seen["attached"].instances) == 2
