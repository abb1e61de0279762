"""``/metrics``: valid Prometheus text exposition, with the state a scraper needs."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from staleflow.dashboard import prometheus
from staleflow.dashboard.app import create_app
from tests.staleflow.dashboard.fakes import ETA, INSTANCES, FakeSource

_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? '
    r"(-?[0-9.e+-]+|NaN|[+-]Inf)$"
)


def _scrape() -> str:
    r = TestClient(create_app(FakeSource())).get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return r.text


def test_every_line_is_valid_and_every_family_declared_once_before_its_samples():
    declared: list[str] = []
    for line in _scrape().splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind == "gauge" and name not in declared
            declared.append(name)
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        assert m.group(1) == declared[-1], f"{line!r} is not under its family"


def test_parses_with_the_reference_parser_and_carries_the_state():
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(_scrape())}
    samples = {f.name: f.samples for f in families.values()}
    assert samples["staleflow_steps"][0].value == 5
    assert samples["staleflow_trainer_version"][0].value == 0
    assert len(samples["staleflow_buffer_capacity"]) == ETA + 1
    running = {s.labels["instance"]: s.value for s in samples["staleflow_instance_running"]}
    assert running == {str(i): i + 1 for i in range(INSTANCES)}
    states = [s for s in samples["staleflow_buffer_state"] if s.value == 1]
    assert len(states) == ETA + 1  # one state per buffer
    routed = {
        s.labels["v_traj"]: s.value
        for s in samples["staleflow_ts_trajectories_by_version"]
        if s.labels["state"] == "routed"
    }
    assert routed == {"0": 4, "1": 2}
    assert samples["staleflow_last_step_throughput_tokens_per_s"][0].value == 500
    hist = {s.labels["staleness"]: s.value for s in samples["staleflow_last_step_staleness_groups"]}
    assert hist == {"0": 3, "1": 1}
    # staleness as a first-class metric: its mean, and the correction's share beside it
    assert samples["staleflow_last_step_staleness_mean"][0].value == 0.25
    assert samples["staleflow_last_step_train_corrected_frac"][0].value == 0.125
    # speculative decoding's counters, where it is on (5 steps: 20 verifications, ...)
    assert samples["staleflow_last_step_speculation_accepted"][0].value == 50
    assert samples["staleflow_last_step_speculation_wasted"][0].value == 50
    assert samples["staleflow_last_step_speculation_accepted_per_verification"][0].value == 2.5
    # the unknown measured throughput of instance 2 (NaN) is exported as NaN
    measured = {
        s.labels["instance"]: s.value
        for s in samples["staleflow_instance_measured_tokens_per_second"]
    }
    assert math.isnan(measured["2"]) and measured["1"] == 50


def test_label_values_and_help_are_escaped():
    out = prometheus.Exposition()
    out.gauge("odd/name-1", "help with \\ and\nnewline", 1.5, label='a "quoted" \\ value\n')
    out.gauge("absent", "unknown values are left out", None)
    text = out.render()
    assert "staleflow_odd_name_1" in text and "absent" not in text
    assert '{label="a \\"quoted\\" \\\\ value\\n"} 1.5' in text
    assert "# HELP staleflow_odd_name_1 help with \\\\ and\\nnewline" in text
