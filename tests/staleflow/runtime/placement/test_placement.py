"""The placement plan (pure data from the config) and its fit to a cluster's nodes. No
Ray: nodes are plain records, as :meth:`RayCluster.nodes` would report them."""

from __future__ import annotations

import pytest

from staleflow.config import load_config
from staleflow.runtime.errors import PlacementError
from staleflow.runtime.placement.fitting import Node, fit
from staleflow.runtime.placement.plan import NODE_RESOURCE_SHARE, Bundle, NodeGroup, plan_placement

POOL = "staleflow.io/pool"


def _plan(*overrides: str, ranks: int = 1):
    cfg = load_config(None, list(overrides))
    return plan_placement(cfg.resources, cfg.rollout, cfg.trainer, cfg.reward, trainer_ranks=ranks)


def _members(placement) -> dict[str, str]:
    return {
        role: node
        for p in placement.gangs
        for role, node in zip(p.gang.roles, p.nodes, strict=True)
    }


def test_the_default_plan_is_the_single_machine_run():
    plan = _plan()
    assert [g.name for g in plan.gangs] == [
        "rollout/0",
        "rollout/1",
        "trainer",
        "reward",
        "control",
    ]
    assert [g.roles for g in plan.pool("rollout")] == [("instance/0",), ("instance/1",)]
    assert plan.pool("control")[0].roles == ("control", "ts")
    # 2 instances + trainer + reward + control + TS + one PS replica, a CPU each
    assert plan.totals() == {"CPU": 7.0}
    assert plan.totals(rollout_nodes=3) == {"CPU": 9.0}
    lines = plan.describe()
    assert [line.split()[0] for line in lines] == [
        "rollout",
        "parameter_server",
        "trainer",
        "reward",
        "control",
    ]
    assert "2 instances x 1 TP rank" in lines[0] and "any node" in lines[0]
    assert "the rollout nodes" in lines[1]


def test_resources_tp_ranks_and_node_groups_come_from_the_config():
    plan = _plan(
        "rollout.backend=sglang",
        "model.checkpoint=/models/m",
        "rollout.instances=3",
        "rollout.tensor_parallel=4",
        "resources.rollout.gpus=1",
        "resources.rollout.cpus=2",
        f"resources.rollout.node_label={POOL}=rollout",
        "resources.trainer.gpus=1",
        "resources.trainer.node_resource=trainer_nodes",
        "resources.reward.cpus=0.5",
        "reward.workers=4",
        ranks=8,
    )
    (first, *_) = plan.pool("rollout")
    assert first.roles == ("instance/0", "instance/0/tp1", "instance/0/tp2", "instance/0/tp3")
    assert first.same_node  # its TP GPUs on one node
    assert first.bundle == Bundle(2.0, 1.0, NodeGroup(label=(POOL, "rollout")))
    assert first.total() == {"CPU": 8.0, "GPU": 4.0}
    (trainer,) = plan.pool("trainer")
    assert len(trainer.roles) == 8 and not trainer.same_node
    assert trainer.bundle.resources() == {
        "CPU": 1.0,
        "GPU": 1.0,
        "trainer_nodes": NODE_RESOURCE_SHARE,
    }
    assert plan.pool("reward")[0].roles == tuple(f"reward/{w}" for w in range(4))
    assert plan.totals()["GPU"] == 3 * 4 + 8


def test_a_bundle_that_asks_for_nothing_still_holds_a_token_share():
    # Ray refuses empty bundles
    assert Bundle(0.0).resources() == {"CPU": NODE_RESOURCE_SHARE}


def test_everything_fits_on_one_machine_with_one_replica():
    placement = fit(_plan(), [Node("n0", "10.0.0.1", {"CPU": 8})])
    members = _members(placement)
    assert set(members.values()) == {"n0"}
    assert sorted(r for r in members if r.startswith("ps/")) == ["ps/0"]
    assert placement.replica_on("n0") == "ps/0"
    assert placement.describe() == [
        "node n0 (10.0.0.1): ps/0, instance/0, instance/1, trainer/0, reward/0, control, ts"
    ]


CLUSTER = [
    Node("head", "10.0.0.1", {"CPU": 4, "head": 1}),
    Node("gpu-a", "10.0.0.2", {"CPU": 4, "GPU": 1}, {POOL: "rollout"}),
    Node("gpu-b", "10.0.0.3", {"CPU": 4, "GPU": 1}, {POOL: "rollout"}),
    Node("train", "10.0.0.4", {"CPU": 2, "GPU": 1}, {POOL: "trainer"}),
]
GROUPS = [
    "resources.rollout.gpus=1",
    f"resources.rollout.node_label={POOL}=rollout",
    "resources.trainer.gpus=1",
    f"resources.trainer.node_label={POOL}=trainer",
    "resources.control.node_resource=head",
    "resources.reward.node_resource=head",
]


def test_each_pool_goes_to_its_node_group_with_one_replica_per_rollout_node():
    placement = fit(_plan(*GROUPS), CLUSTER)
    m = _members(placement)
    assert {m["instance/0"], m["instance/1"]} == {"gpu-a", "gpu-b"}
    assert m["trainer/0"] == "train"
    assert m["control"] == m["ts"] == m["reward/0"] == "head"
    replicas = {role: node for role, node in m.items() if role.startswith("ps/")}
    assert sorted(replicas.values()) == ["gpu-a", "gpu-b"]
    for inst in ("instance/0", "instance/1"):
        assert placement.node_of(placement.replica_on(m[inst])) == m[inst]
    assert [n.node_id for n in placement.nodes] == ["head", "gpu-a", "gpu-b", "train"]
    data = placement.as_dict()
    assert {g["name"] for g in data["gangs"]} >= {"ps/0", "ps/1", "rollout/0", "trainer"}


def test_instances_share_a_node_that_already_has_a_replica():
    nodes = [Node("a", "", {"CPU": 8, "GPU": 2}), Node("b", "", {"CPU": 8, "GPU": 2})]
    placement = fit(_plan("resources.rollout.gpus=1"), nodes)
    m = _members(placement)
    assert m["instance/0"] == m["instance/1"] == "a"
    assert [r for r in m if r.startswith("ps/")] == ["ps/0"]


def test_an_instance_needs_room_for_its_nodes_replica_too():
    # gpu-a has the instance's CPU and GPU but not the CPU of a PS replica as well
    nodes = [
        Node("gpu-a", "", {"CPU": 1, "GPU": 1}),
        Node("gpu-b", "", {"CPU": 2, "GPU": 1}),
        Node("cpu", "", {"CPU": 8}),
    ]
    placement = fit(_plan("resources.rollout.gpus=1", "rollout.instances=1"), nodes)
    m = _members(placement)
    assert m["instance/0"] == m["ps/0"] == "gpu-b"


def test_tp_ranks_never_split_across_nodes():
    nodes = [Node("a", "", {"CPU": 8, "GPU": 2}), Node("b", "", {"CPU": 8, "GPU": 2})]
    plan = _plan(
        "rollout.backend=sglang",
        "model.checkpoint=/m",
        "rollout.instances=1",
        "rollout.tensor_parallel=3",
        "resources.rollout.gpus=1",
    )
    with pytest.raises(PlacementError) as refused:
        fit(plan, nodes)  # 4 GPUs in all, but no node has 3
    (why,) = refused.value.missing
    assert why.startswith("rollout/0 needs CPU 3, GPU 3 on one node")
    assert "the most room on any node is CPU 8, GPU 2" in why


def test_members_of_a_spread_pool_may_use_several_nodes():
    nodes = [Node("a", "", {"CPU": 4}), Node("b", "", {"CPU": 4})]
    placement = fit(
        _plan("reward.workers=3", "resources.reward.cpus=1", "rollout.instances=1"), nodes
    )
    m = _members(placement)
    assert {m[f"reward/{w}"] for w in range(3)} == {"a", "b"}


def test_what_is_missing_is_named_pool_by_pool_with_the_totals():
    nodes = CLUSTER[:2] + CLUSTER[3:]  # one rollout node lost
    with pytest.raises(PlacementError) as refused:
        fit(_plan(*GROUPS), nodes)
    missing = refused.value.missing
    assert len(missing) == 2, missing
    assert missing[0].startswith("rollout/1 needs CPU 1, GPU 1 on one node")
    assert f"nodes labelled {POOL}=rollout is CPU 2, GPU 0 on node gpu-a (10.0.0.2)" in missing[0]
    assert missing[1] == "in all the plan asks GPU 3, the cluster has GPU 2 free"
    assert "docs/cluster.md" in str(refused.value)


def test_a_node_group_no_node_belongs_to_is_named():
    with pytest.raises(
        PlacementError, match=r"trainer needs .* the cluster has no nodes with resource big_gpus"
    ):
        fit(_plan("resources.trainer.node_resource=big_gpus"), [Node("n", "", {"CPU": 64})])


def test_the_fit_uses_what_is_free_not_what_a_node_has():
    busy = Node("n", "", {"CPU": 3})  # another job holds the rest of the node
    with pytest.raises(
        PlacementError, match="in all the plan asks CPU 7, the cluster has CPU 3 free"
    ):
        fit(_plan(), [busy])
