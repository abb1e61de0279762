"""The JSON API in process (TestClient) over a fake run: shapes, counts and bad requests."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from staleflow.dashboard.app import MAX_LIMIT, create_app
from tests.staleflow.dashboard.fakes import ETA, INSTANCES, FakeSource


@pytest.fixture
def source() -> FakeSource:
    return FakeSource()


@pytest.fixture
def client(source: FakeSource) -> TestClient:
    return TestClient(create_app(source, token="s3cret"))


def test_run_and_overview(client):
    run = client.get("/api/run").json()
    assert run["kind"] == "live" and run["name"] == "fake-run"
    assert run["steps"] == 5 and run["trainer_version"] == 0 and run["ps_version"] == 2
    assert run["actions"] == ["poke"]
    overview = client.get("/api/overview").json()
    assert set(overview) == {"run", "buffers", "instances", "ts", "ps"}
    assert len(overview["buffers"]["buffers"]) == ETA + 1
    assert len(overview["instances"]["instances"]) == INSTANCES


def test_buffers_mirror_the_staleness_manager(client, source):
    body = client.get("/api/buffers").json()
    view = source.manager.view()
    assert body["available"] and body["trainer_version"] == view.version == 0
    assert body["eta"] == ETA and body["batch_size"] == 4 and body["group_size"] == 2
    assert [b["version"] for b in body["buffers"]] == [b.version for b in view.buffers]
    assert [b["state"] for b in body["buffers"]] == [b.state.value for b in view.buffers]
    for got, want in zip(body["buffers"], view.buffers, strict=True):
        assert got["capacity"] == want.capacity
        assert got["occupied"] == want.occupied and got["reserved"] == want.reserved
        assert [(e["group_id"], e["version"], e["kind"]) for e in got["entries"]] == [
            (e.group_id, e.version, e.kind.value) for e in want.entries
        ]
    assert body["occupied_groups"] == 3 and body["reserved_groups"] == 2


def test_instances_carry_snapshot_fields_and_estimates(client):
    body = client.get("/api/instances").json()
    assert body["cost_model"]["k1"] == pytest.approx(7.28e-8)
    insts = body["instances"]
    assert [d["inst"] for d in insts] == list(range(INSTANCES))
    for d in insts:
        assert d["model_version"] == 1
        assert d["running"] == d["inst"] + 1 and d["waiting"] == 1 and d["completed"] == 2
        assert d["accum_traj_num"] == d["running"] + 3
        assert d["run_trajs"] is None  # only with ?trajectories=true
        assert d["throughput_estimate_tokens_per_s"] > 0
        assert d["last_cycle_commands"] == {"route": d["inst"]}
    assert insts[2]["measured_tokens_per_s"] is None  # NaN is not JSON: unknown
    full = client.get("/api/instances", params={"trajectories": "true"}).json()["instances"]
    assert len(full[1]["run_trajs"]) == 2 and full[1]["complete_trajs"] == [5, 6]
    one = client.get("/api/instances/2").json()
    assert one["inst"] == 2 and len(one["run_trajs"]) == 3 and one["wait_trajs"][0]["v_traj"] == 1


def test_ts_and_ps(client):
    ts = client.get("/api/ts").json()
    assert ts["available"] and ts["by_state"] == {
        "queued": 3,
        "routed": 6,
        "completed": 1,
        "initial": 2,
    }
    assert ts["by_v_traj"]["routed"] == {"0": 4, "1": 2}
    assert ts["totals"]["created_trajectories"] == 12
    ps = client.get("/api/ps").json()
    assert ps["latest"] == 2 and ps["held"] == [1, 2] and ps["version_bytes"] is None
    assert ps["last_pull_s"] == {"0": 3.0} and ps["notes"] == ["sizes unknown"]


def test_metrics_paging_and_prefix(client):
    page = client.get("/api/metrics", params={"since": 1, "limit": 2}).json()
    assert (page["start"], page["next"], page["total"]) == (1, 3, 5)
    assert [r["step"] for r in page["records"]] == [2.0, 3.0]
    rest = client.get("/api/metrics", params={"since": page["next"]}).json()
    assert [r["step"] for r in rest["records"]] == [4.0, 5.0]
    past = client.get("/api/metrics", params={"since": 99}).json()
    assert past["records"] == [] and past["next"] == 5
    only = client.get("/api/metrics", params={"prefix": "throughput/"}).json()["records"][0]
    assert set(only) == {
        "step",
        "version",
        "time/elapsed_s",
        "throughput/tokens_per_s",
        "throughput/step_tokens_per_s",
    }


def test_staleness_load_and_events(client):
    rows = client.get("/api/staleness").json()["buffers"]
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["hist"] == {"0": 3, "1": 1} and rows[0]["max"] == 1
    load = client.get("/api/load", params={"limit": 4}).json()
    assert load["total"] == 10 * INSTANCES and len(load["samples"]) == 4
    events = client.get("/api/events", params={"kind": ["pull", "push"]}).json()["events"]
    assert [e["kind"] for e in events] == ["pull", "push"] and events[0]["inst"] == 0


@pytest.mark.parametrize(
    ("path", "params", "word"),
    [
        ("/api/metrics", {"since": -1}, "since"),
        ("/api/metrics", {"since": "abc"}, "since"),
        ("/api/metrics", {"since": "1.5"}, "since"),
        ("/api/metrics", {"limit": 0}, "limit"),
        ("/api/metrics", {"limit": MAX_LIMIT + 1}, "limit"),
        ("/api/metrics", {"prefix": "x" * 201}, "prefix"),
        ("/api/staleness", {"limit": -5}, "limit"),
        ("/api/load", {"since": "NaN"}, "since"),
        ("/api/events", {"kind": "nonsense"}, "kind"),
        ("/api/instances", {"trajectories": "perhaps"}, "trajectories"),
        ("/api/instances/-1", {}, "inst"),
        ("/api/instances/abc", {}, "inst"),
    ],
)
def test_bad_parameters_are_422_with_a_message(client, path, params, word):
    r = client.get(path, params=params)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and word in detail


def test_unknown_things_are_404_with_a_message(client):
    r = client.get("/api/instances/99")
    assert r.status_code == 404 and "instances are 0, 1, 2" in r.json()["detail"]
    assert client.get("/api/nothing").status_code == 404
    assert client.get("/static/../app.py").status_code == 404
    assert client.get("/static/secrets.txt").status_code == 404
    assert client.post("/api/buffers").status_code == 405


def test_actions_need_the_token(client, source):
    assert client.post("/api/actions/poke").status_code == 401
    wrong = client.post("/api/actions/poke", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "token" in wrong.json()["detail"]
    assert source.acted == []
    ok = client.post("/api/actions/poke", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json() == {"action": "poke", "result": "did poke"}
    assert source.acted == ["poke"]
    unknown = client.post("/api/actions/explode", headers={"Authorization": "Bearer s3cret"})
    assert unknown.status_code == 400 and "poke" in unknown.json()["detail"]


@pytest.mark.parametrize(
    "authorization",
    [
        "s3cret",  # the bare token, without the scheme
        "Basic s3cret",
        "Token s3cret",
        "Bearer",
        "Bearer ",
        "Bearers3cret",
        "Bearer  s3cret",  # the token is everything after the one space
        "Bearer s3cret2",
        "Bearer s3cre",
        "s3cret Bearer",
    ],
)
def test_actions_need_exactly_bearer_and_the_token(client, source, authorization):
    r = client.post("/api/actions/poke", headers={"Authorization": authorization})
    assert r.status_code == 401, authorization
    assert "Authorization: Bearer <token>" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert source.acted == []


def test_the_bearer_scheme_is_case_insensitive_the_token_is_not(client, source):
    ok = client.post("/api/actions/poke", headers={"Authorization": "bearer s3cret"})
    assert ok.status_code == 200 and source.acted == ["poke"]
    wrong = client.post("/api/actions/poke", headers={"Authorization": "Bearer S3CRET"})
    assert wrong.status_code == 401 and "wrong token" in wrong.json()["detail"]
    missing = client.post("/api/actions/poke")
    assert missing.status_code == 401 and "missing token" in missing.json()["detail"]
    assert source.acted == ["poke"]


def test_a_non_ascii_token_is_compared_as_utf8_bytes(source):
    token = "clé-токен-🔑"
    client = TestClient(create_app(source, token=token))
    ok = client.post(
        "/api/actions/poke", headers={"Authorization": ("Bearer " + token).encode("utf-8")}
    )
    assert ok.status_code == 200 and ok.json()["result"] == "did poke"
    for wrong in ("Bearer cle-токен-🔑", "Bearer clé-токен", token):
        r = client.post("/api/actions/poke", headers={"Authorization": wrong.encode("utf-8")})
        assert r.status_code == 401 and "Bearer <token>" in r.json()["detail"], wrong
    assert source.acted == ["poke"]


def test_actions_are_off_without_a_token(source):
    client = TestClient(create_app(source))
    r = client.post("/api/actions/poke", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "--token" in r.json()["detail"]
    assert source.acted == []


def test_an_action_the_source_refuses_is_400():
    source = FakeSource(actions=("refuse",))
    client = TestClient(create_app(source, token="t"))
    r = client.post("/api/actions/refuse", headers={"Authorization": "Bearer t"})
    assert r.status_code == 400 and r.json()["detail"] == "cannot refuse now"


def test_a_failing_source_is_a_json_500_and_the_app_goes_on(source):
    calls = {"n": 0}
    live = source.live

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return live()

    source.live = flaky
    client = TestClient(create_app(source), raise_server_exceptions=False)
    r = client.get("/api/buffers")
    assert r.status_code == 500 and "RuntimeError" in r.json()["detail"]
    assert client.get("/api/buffers").status_code == 200


def test_openapi_documents_the_response_schemas(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for name in ("BuffersOut", "BufferOut", "InstanceOut", "TSOut", "PSOut", "RecordsOut"):
        assert name in schemas
    assert "V_buf" in schemas["BufferOut"]["properties"]["version"]["description"]
    ok = spec["paths"]["/api/buffers"]["get"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"]["$ref"].endswith("/BuffersOut")
    since = next(
        p for p in spec["paths"]["/api/metrics"]["get"]["parameters"] if p["name"] == "since"
    )
    assert since["schema"]["minimum"] == 0
    assert client.get("/docs").status_code == 200
