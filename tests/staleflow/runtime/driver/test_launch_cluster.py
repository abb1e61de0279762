"""``staleflow launch --address`` on a real multi-node Ray cluster started on this machine.

``ray.cluster_utils.Cluster`` starts one raylet per node; distinct resources and labels
stand in for node groups and GPUs (a GPU here is a scheduling token: the embedded engine
and trainer run on CPU whatever they reserve):

==========  ===============================  =============================
node        advertises                       runs (per the plan)
==========  ===============================  =============================
head        CPU 3, resource staleflow_head   control, TS, reward (driver)
rollout A   CPU 2, GPU 1, label pool=rollout  instance, PS replica
rollout B   CPU 2, GPU 1, label pool=rollout  instance, PS replica
trainer     CPU 1, GPU 1, resource trainer   trainer rank
==========  ===============================  =============================

Everything is asserted from Ray's own records (``ray.util.state.list_actors`` and the
placement-group table), read while the run trains; plus what every launch must show.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.staleflow.runtime.driver.launch_checks import MICRO_RUN, check_run

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

STEPS = 4
POOL = "staleflow.io/pool"
COMMON = [
    f"steps={STEPS}",
    "eta=1",
    *MICRO_RUN,
    "dashboard=false",
    "eval_problems=0",
    "rollout.instances=2",
    "resources.rollout.gpus=1",
    f"resources.rollout.node_label={POOL}=rollout",
    "resources.trainer.gpus=1",
    "resources.trainer.node_resource=staleflow_trainer",
    "resources.control.node_resource=staleflow_head",
    "resources.reward.node_resource=staleflow_head",
    "resources.parameter_server.cpus=0.5",
]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 3,
            "resources": {"staleflow_head": 1},
            "_system_config": {"worker_niceness": 0},  # as deploy/ starts Ray
        },
    )
    nodes = {"head": c.head_node}
    for name in ("rollout-a", "rollout-b"):
        nodes[name] = c.add_node(num_cpus=2, num_gpus=1, labels={POOL: "rollout"})
    nodes["trainer"] = c.add_node(num_cpus=1, num_gpus=1, resources={"staleflow_trainer": 1})
    c.wait_for_nodes()
    try:
        yield c, {name: n.node_id for name, n in nodes.items()}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _ray_records(address: str, run: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(actor name -> node id, placement group name -> node id of each bundle) of ``run``,
    as Ray reports them."""
    import ray
    from ray.util.state import list_actors

    # the state API is served by the cluster's dashboard, which Ray starts on its own
    # time: on a loaded machine it was not up yet when the run's first step came
    deadline = time.monotonic() + 300
    while True:
        try:
            listed = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    actors = {
        a.name.removeprefix(f"{run}/"): a.node_id
        for a in listed
        if a.name and a.name.startswith(f"{run}/")
    }
    groups = {
        pg["name"].removeprefix(f"{run}/"): [
            pg["bundles_to_node_id"][i] for i in sorted(pg["bundles_to_node_id"])
        ]
        for pg in ray.util.placement_group_table().values()
        if pg["name"].startswith(f"{run}/") and pg["state"] == "CREATED"
    }
    return actors, groups


@pytest.mark.slow  # three raylets and a launch (72 s on CI); test_placement covers the plan
def test_every_actor_lands_where_its_plan_says_and_weights_take_the_planned_routes(
    cluster, tmp_path, monkeypatch
):
    # Ray's state API lets RAY_ADDRESS override the address it is given (ray 2.60,
    # ray/dashboard/utils.py, get_address_for_submission_client): with RAY_ADDRESS=local
    # and other Ray instances on the machine it cannot tell which one is meant
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from staleflow.config import load_config
    from staleflow.dashboard.ray_source import RaySource
    from staleflow.runfolder.step_record import StepRecord
    from staleflow.runtime.driver.launch import launch

    c, node = cluster
    # Ray's state API (list_actors) takes RAY_ADDRESS over its address argument (ray
    # 2.5x dashboard/utils.py get_address_for_submission_client): RAY_ADDRESS=local, as
    # the default suite may run, would send it to a local Ray instead of this cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, [*COMMON, f"address={c.address}", f"run_dir={tmp_path}"])
    seen: dict[str, object] = {}

    def on_record(rec: StepRecord) -> None:
        if seen:
            return
        run = next(tmp_path.iterdir()).name
        seen["run"] = run
        seen["actors"], seen["groups"] = _ray_records(c.address, run)
        # another driver (as on another node) finds the run by its actors' names
        status = subprocess.run(
            [sys.executable, "-m", "staleflow.cli", "status", "--address", c.address],
            capture_output=True,
            text=True,
            timeout=300,
        )
        seen["status"] = (status.returncode, status.stdout + status.stderr)
        source = RaySource.attach(c.address, run=run, run_dir=str(tmp_path / run))
        try:
            assert source.poll_once()
            seen["dashboard"] = source.info().placement
            seen["dashboard_ps"] = source.handles.ps is not None
        finally:
            source.close()

    result = launch(cfg, on_record=on_record)
    check_run(result, eta=1, steps=STEPS, trajectories_per_step=2 * 4)

    plan = result.summary.placement
    planned = {role: n for g in plan["gangs"] for role, n in g["members"].items()}
    # node groups: the plan put each pool on its group
    rollout_nodes = {node["rollout-a"], node["rollout-b"]}
    assert {planned["instance/0"], planned["instance/1"]} == rollout_nodes  # one GPU each
    assert planned["trainer/0"] == node["trainer"]
    assert planned["control"] == planned["ts"] == planned["reward/0"] == node["head"]
    # one PS replica per rollout node, nowhere else
    replicas = {role: n for role, n in planned.items() if role.startswith("ps/")}
    assert sorted(replicas.values()) == sorted(rollout_nodes), replicas
    # Ray's records: every actor runs on the node its plan names, every bundle too
    actors, groups = seen["actors"], seen["groups"]
    assert actors == {role: n for role, n in planned.items()}, (actors, planned)
    for gang in plan["gangs"]:
        assert groups[gang["name"]] == list(gang["members"].values()), (gang, groups)
    # an instance Pulls from the replica on its own node over shared memory; the trainer
    # Pushes to every replica, across nodes (NIXL, or TCP where NIXL cannot start)
    weights = plan["weights"]
    for inst in ("instance/0", "instance/1"):
        route = weights["pull"][inst]
        assert replicas[route["replica"]] == planned[inst] and route["transport"] == "shm"
    pushed = {p["replica"]: p["transport"] for p in weights["push"] if p["sender"] == "trainer/0"}
    assert set(pushed) == set(replicas) and set(pushed.values()) <= {"nixl", "socket"}, pushed
    assert all(p["bytes"] > 0 for p in weights["push"])
    # and it reached every replica: each holds the last version (check_run's ps_latest)
    assert set(result.summary.audit["ps_latest"]) == set(replicas)
    # found from another process by name, and the dashboard shows the placement
    code, text = seen["status"]
    assert code == 0 and seen["run"] in text, text
    assert seen["dashboard_ps"] and seen["dashboard"]["weights"]["pull"] == weights["pull"]


def test_a_plan_the_cluster_cannot_hold_is_refused_before_anything_starts(
    cluster, tmp_path, monkeypatch
):
    import ray

    from staleflow.config import load_config
    from staleflow.runtime.driver import launch as launching
    from staleflow.runtime.driver.launch import PlacementError

    c, _ = cluster

    def never(*args, **kwargs):
        raise AssertionError("the policy was prepared for a plan the cluster cannot hold")

    monkeypatch.setattr(launching, "prepare_policy", never)
    cfg = load_config(
        None, [*COMMON, "rollout.instances=3", f"address={c.address}", f"run_dir={tmp_path}"]
    )
    with pytest.raises(PlacementError) as refused:
        launching.launch(cfg)
    text = str(refused.value)
    assert "rollout/2 needs CPU 1, GPU 1" in text and f"labelled {POOL}=rollout" in text, text
    assert "GPU 0" in text, text  # where the most room was: no GPU left on a rollout node
    assert not any(tmp_path.iterdir()), "no run folder for a launch that never started"
    ray.init(address=c.address)
    try:
        held = [
            pg["name"]
            for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED"  # the first test's groups stay listed, removed
        ]
        assert not held, f"nothing may be reserved, but {held} are"
    finally:
        ray.shutdown()
