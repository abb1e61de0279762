"""Reserving a placement that fit on paper but that Ray cannot reserve (another job took
the room since the check) stops with the groups still pending and leaves nothing
reserved. A local Ray of 2 CPUs; the placement claims a node with more."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.ray


def test_a_placement_ray_cannot_reserve_is_named_and_released():
    import ray

    from staleflow.runtime.errors import PlacementError
    from staleflow.runtime.placement.fitting import Node, fit
    from staleflow.runtime.placement.plan import Bundle, Gang, PlacementPlan
    from staleflow.runtime.placement.ray_cluster import RayCluster, worker_niceness

    if ray.is_initialized():
        ray.shutdown()
    cluster = RayCluster.connect("", local_cpus=2)
    try:
        # the actors of a local Ray run at the caller's niceness, not 15 above it (Ray's
        # default: they yielded the CPU to any other process, 25x slower beside two busy
        # loops). Workers inherit the caller's niceness: under `nice -n 5` both are 5,
        # and Ray must add nothing to it
        assert worker_niceness(cluster.ray) == os.nice(0)
        (real,) = cluster.nodes()
        assert real.free["CPU"] == 2
        stale = Node(real.node_id, real.address, {"CPU": 8}, real.labels)  # as if 8 were free
        plan = PlacementPlan(
            (
                Gang("small", "control", ("a",), Bundle(1.0), True),
                Gang("big", "trainer", ("b",), Bundle(4.0), True),
            ),
            Bundle(0.5),
        )
        placement = fit(plan, [stale])
        with pytest.raises(
            PlacementError,
            match=r"Ray did not reserve big within resources.placement_timeout_s=2 s",
        ):
            cluster.reserve(placement, "run-x", timeout_s=2)
        live = [
            pg["name"]
            for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED"
        ]
        assert live == [], live  # the one that was reserved ("small") is given back too
    finally:
        cluster.shutdown()
