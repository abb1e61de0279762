"""The files under ``deploy/``: each parses, has the fields its tool requires, and
describes a cluster that holds the placement ``staleflow launch`` asks for with
``deploy/staleflow.yaml``: the nodes each file brings up are fitted with the launcher's
own :func:`staleflow.runtime.placement.fitting.fit`, so a resource name that differs between a file
and the config, or a group too small for its pool, fails here. No Ray, no cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from staleflow.config import load_config
from staleflow.runtime.driver.run_plan import plan_run
from staleflow.runtime.placement.fitting import Node, fit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SBATCH = DEPLOY / "slurm" / "staleflow.sbatch"
BASE = {"CPU", "GPU", "memory", "object_store_memory"}


def _plan():
    return plan_run(load_config(DEPLOY / "staleflow.yaml", [])).placement.plan


def _asked_markers() -> set[str]:
    plan = _plan()
    bundles = [g.bundle for g in plan.gangs] + [plan.ps_replica]
    return {key for b in bundles for key in b.resources() if key not in BASE}


def _check_cluster(nodes: list[Node]) -> None:
    """The plan fits, each pool on its group, and every group marker is one the plan uses."""
    placement = fit(_plan(), nodes)
    group = {n.node_id: n.node_id.split("/")[0] for n in nodes}
    where = {
        role: group[node]
        for p in placement.gangs
        for role, node in zip(p.gang.roles, p.nodes, strict=True)
    }
    assert {where[r] for r in where if r.startswith("instance/")} == {"rollout"}
    assert {where[r] for r in where if r.startswith("ps/")} == {"rollout"}
    assert {where[r] for r in where if r.startswith("trainer/")} == {"trainer"}
    assert where["control"] == where["ts"] == "head"
    advertised = {key for n in nodes for key in n.free if key not in BASE}
    assert advertised == _asked_markers(), advertised


def test_the_run_config_pins_every_pool_to_a_group():
    assert _asked_markers() == {
        "staleflow_head",
        "staleflow_rollout",
        "staleflow_trainer",
        "staleflow_cpu",
    }


# -- Ray cluster launcher -------------------------------------------------------------------


def test_the_cluster_launcher_yaml_is_complete_and_holds_the_placement():
    spec = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in (
        "cluster_name",
        "provider",
        "auth",
        "available_node_types",
        "head_node_type",
        "setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ):
        assert key in spec, key
    assert spec["provider"]["type"]
    types = spec["available_node_types"]
    assert spec["head_node_type"] in types
    nodes = []
    for name, node_type in types.items():
        assert {"node_config", "resources", "min_workers", "max_workers"} <= set(node_type), name
        assert node_type["min_workers"] <= node_type["max_workers"]
        count = 1 if name == spec["head_node_type"] else node_type["min_workers"]
        nodes += [Node(f"{name}/{i}", "", dict(node_type["resources"])) for i in range(count)]
    workers = sum(t["max_workers"] for n, t in types.items() if n != spec["head_node_type"])
    assert workers <= spec["max_workers"]
    assert any("ray-node head" in c for c in spec["head_start_ray_commands"])
    _check_cluster(nodes)


# -- KubeRay ---------------------------------------------------------------------------------


def _kuberay_node(name: str, group: dict) -> Node:
    params = group.get("rayStartParams", {})
    for value in params.values():
        assert isinstance(value, str), f"{name}: rayStartParams values are strings in KubeRay"
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    free = {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
    if "num-gpus" in params:
        free["GPU"] = float(params["num-gpus"])
    if "resources" in params:  # '"{\"name\": 1}"': a JSON object inside a quoted string
        free.update(json.loads(json.loads(params["resources"])))
    return Node(name, "", free)


def test_the_kuberay_manifest_has_rollout_trainer_and_cpu_groups_that_hold_the_placement():
    spec = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert spec["apiVersion"] == "ray.io/v1" and spec["kind"] == "RayCluster"
    major, minor = (int(x) for x in spec["spec"]["rayVersion"].split(".")[:2])
    assert (major, minor) >= (2, 49), "launch pins bundles with the ray.io/node-id label"
    groups = {g["groupName"]: g for g in spec["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"rollout", "trainer", "cpu"}
    nodes = [_kuberay_node("head/0", spec["spec"]["headGroupSpec"])]
    for name, group in groups.items():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        nodes += [_kuberay_node(f"{name}/{i}", group) for i in range(group["replicas"])]
    _check_cluster(nodes)


# -- SLURM -----------------------------------------------------------------------------------


def _sbatch_value(text: str, name: str) -> str:
    match = re.search(rf"^{name}=(.+)$", text, re.MULTILINE)
    assert match, f"{SBATCH.name} sets no {name}"
    return match.group(1).strip().strip("'\"")


def test_the_slurm_script_is_valid_bash_and_its_nodes_hold_the_placement():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    if shutil.which("shellcheck"):  # apt-get install shellcheck
        result = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    text = SBATCH.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.MULTILINE))
    rollout, trainer = (
        int(_sbatch_value(text, "ROLLOUT_NODES")),
        int(_sbatch_value(text, "TRAINER_NODES")),
    )
    assert int(sbatch["nodes"]) == 1 + rollout + trainer
    gpus = float(_sbatch_value(text, "GPUS_PER_NODE"))
    assert gpus == float(sbatch["gpus-per-node"])
    cpus = float(sbatch["cpus-per-task"])

    def node(name: str, role: str, gpus: float) -> Node:
        return Node(name, "", {"CPU": cpus, "GPU": gpus, **json.loads(_sbatch_value(text, role))})

    nodes = [node("head/0", "HEAD_RESOURCES", 0.0)]
    nodes += [node(f"rollout/{i}", "ROLLOUT_RESOURCES", gpus) for i in range(rollout)]
    nodes += [node(f"trainer/{i}", "TRAINER_RESOURCES", gpus) for i in range(trainer)]
    _check_cluster(nodes)
    assert re.search(r"^staleflow launch --config .* --address ", text, re.MULTILINE)


RAY_NODE = DEPLOY / "ray-node"


def test_the_node_script_starts_ray_unniced_and_with_token_auth():
    """Ray starts worker processes at nice 15 unless RAY_worker_niceness says otherwise,
    and (Ray >= 2.59) a raylet without RAY_AUTH_MODE=token never joins a head that has a
    token: deploy/ray-node exports both before it starts Ray."""
    subprocess.run(["bash", "-n", str(RAY_NODE)], check=True)
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(RAY_NODE)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    text = RAY_NODE.read_text()
    first_start = text.index("exec ray start")
    for line in ("export RAY_worker_niceness=0", "export RAY_AUTH_MODE=token"):
        assert text.index(line) < first_start, line


def test_every_file_starts_ray_unniced_and_with_token_auth():
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in launcher[key] if "ray start" in c or "ray-node" in c]
        assert starts and all("deploy/ray-node " in c for c in starts), key
    # the launcher machine's token reaches every node
    assert "~/.ray/auth_token" in launcher["file_mounts"].values()
    spec = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert spec["spec"]["authOptions"] == {"mode": "token"}
    major, minor = (int(x) for x in spec["spec"]["rayVersion"].split(".")[:2])
    assert (major, minor) >= (2, 52), "KubeRay's authOptions needs Ray >= 2.52"
    groups = [spec["spec"]["headGroupSpec"], *spec["spec"]["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_worker_niceness") == "0", container["name"]
    text = SBATCH.read_text()
    first_start = text.index('start_node "$head"')
    for line in (
        "export RAY_worker_niceness=0",
        "export RAY_AUTH_MODE=token",
        "export RAY_AUTH_TOKEN",
    ):
        assert text.index(line) < first_start, f"{line} before the first node starts"
    assert "ray start" not in text.replace("`ray start`", ""), "nodes start with ray-node"
    assert '"$ray_node" "$@"' in text


def test_cluster_docs_walk_through_every_file():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    for name in (
        "deploy/staleflow.yaml",
        "deploy/ray-cluster.yaml",
        "deploy/slurm/staleflow.sbatch",
        "deploy/kuberay/raycluster.yaml",
        "deploy/ray-node",
        "RAY_AUTH_MODE=token",
        "staleflow launch --check",
    ):
        assert name in doc, name
