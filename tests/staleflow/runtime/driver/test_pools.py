"""What the pool builders hand Ray, without Ray: each member's actor options (its bundle,
its name, its process environment) and the PS routes (shared memory on the replica's
node, NIXL or TCP across nodes)."""

from __future__ import annotations

from typing import Any

from staleflow.config import PSConfig, load_config
from staleflow.runtime.driver.pools import PoolContext
from staleflow.runtime.driver.pools.parameter_server import PSPool
from staleflow.runtime.placement.fitting import Node, fit
from staleflow.runtime.placement.plan import plan_placement
from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE
from staleflow.runtime.workers.actors import process_env


class FakeReservation:
    """Reservation.options without Ray: records which bundle of which group."""

    def options(self, gang: str, role: str) -> dict[str, Any]:
        return {"bundle": (gang, role)}


def _context() -> PoolContext:
    cfg = load_config(None, ["resources.rollout.gpus=1"])
    nodes = [Node("a", "", {"CPU": 8, "GPU": 1}), Node("b", "", {"CPU": 8, "GPU": 1})]
    plan = plan_placement(cfg.resources, cfg.rollout, cfg.trainer, cfg.reward)
    placement = fit(plan, nodes)
    return PoolContext(None, "run-x", placement, FakeReservation(), "a", True, print)  # type: ignore[arg-type]


def test_a_member_gets_its_bundle_its_name_and_its_process_environment():
    ctx = _context()
    opts = ctx.options("instance/1", process_env(2), max_concurrency=4)
    assert opts["bundle"] == ("rollout/1", "instance/1")
    assert opts["name"] == "run-x/instance/1" and opts["namespace"] == ACTOR_NAMESPACE
    assert opts["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}}
    assert opts["max_concurrency"] == 4
    assert "runtime_env" not in ctx.options("ts")
    assert ctx.options("ps/1")["bundle"] == ("ps/1", "ps/1")


def test_process_settings_are_explicit_per_actor_and_not_set_by_importing():
    import os

    import staleflow.runtime.workers.actors  # noqa: F401  (importing sets nothing)

    before = dict(os.environ)
    assert process_env(1, quiet_downloads=True)["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in process_env(4)
    assert dict(os.environ) == before


def _pool(config: PSConfig) -> PSPool:
    from parameter_server.transport.base import Endpoint

    endpoints = {
        r: Endpoint(f"tcp:10.0.0.{i}:1", "h", "boot", "seg") for i, r in enumerate(("ps/0", "ps/1"))
    }
    return PSPool(
        config, {"ps/0": "actor0", "ps/1": "actor1"}, endpoints, {"ps/0": "a", "ps/1": "b"}
    )


def test_an_instance_pulls_from_its_nodes_replica_and_a_trainer_pushes_to_all():
    pool = _pool(PSConfig())
    local = pool.local("b")
    assert (local.replica, local.same_node, local.intended) == ("ps/1", True, "shm")
    routes = {r.replica: r for r in pool.routes("a")}
    assert routes["ps/0"].intended == "shm"
    assert (routes["ps/1"].same_node, routes["ps/1"].intended) == (False, "nixl")
    forced = _pool(PSConfig(transport="socket", push_transport="socket"))
    assert [r.intended for r in forced.routes("a")] == ["socket", "socket"]
