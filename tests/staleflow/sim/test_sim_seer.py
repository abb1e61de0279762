"""Divided rollout and Seer's scheduling in the simulator (coordinator/seer.py): a chunk
boundary returns the trajectory to the TS with its V_traj, Reserve and per-token versions;
the instance keeps counting it for Eq. 1; and whole runs with it on keep the staleness
bound, lose nothing and count chunks and probe accuracy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import CostModel, SeerConfig
from staleflow.sim import SimCluster, system, tiny
from staleflow.sim.cluster import tail_seconds
from staleflow.sim.engine import EngineCosts, SimInstance, SimTrajectory
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.summary import summarise
from tests.staleflow.sim.test_sim_staleness_bound import assert_within_eta, run
from trajectory_server import TrajState
from trajectory_server.types import RoutedTrajectory

COST = CostModel(k1=1e-6, k2=1e-3, k3=1e-4, k4=2e-3, k5=1.0, kv_budget=10_000.0)


def _seer(config, chunk: int = 200, **coordinator: object):  # type: ignore[no-untyped-def]
    seer = SeerConfig(enabled=True, chunk_tokens=chunk)
    return replace(config, coordinator=replace(config.coordinator, seer=seer, **coordinator))


def test_a_chunk_ends_on_the_instance_and_counts_for_eq_1() -> None:
    inst = SimInstance(0, COST, EngineCosts(), np.random.default_rng(0))
    inst.version = 3
    prefix = np.full(40, 2, np.int32)  # 40 tokens generated earlier, by version 2
    routed = RoutedTrajectory(
        7, 1, 2, 0, "", np.zeros(10, np.int32), prefix, np.zeros(40, np.float32), prefix
    )
    t = SimTrajectory(routed, 10 + 500, inst, end=10 + 40 + 100)
    inst.submit([t], 0.0)
    finished: list[int] = []
    inst.advance(1e9, lambda _t, _i, tr: finished.append(tr.traj_id))
    assert finished == []  # a chunk end is not a completion
    (partial,) = inst.take_returned()
    assert partial.traj_id == 7 and len(partial.tokens) == 140
    assert partial.versions[:40].tolist() == [2] * 40  # the earlier tokens keep theirs
    assert set(partial.versions[40:].tolist()) == {3}
    snap = inst.snapshot()
    assert snap.run_trajs == () and snap.complete_trajs == (7,)  # Eq. 1 still counts it
    assert inst.times.chunks == 1 and inst.take_returned() == []


def test_a_chunk_at_the_target_finishes() -> None:
    inst = SimInstance(0, COST, EngineCosts(), np.random.default_rng(0))
    routed = RoutedTrajectory(
        1, 1, 0, 0, "", np.zeros(10, np.int32), *(np.zeros(0, d) for d in ("i4", "f4", "i4"))
    )
    t = SimTrajectory(routed, 10 + 50, inst, end=10 + 400)  # the chunk reaches past EOS
    inst.submit([t], 0.0)
    finished: list[int] = []
    inst.advance(1e9, lambda _t, _i, tr: finished.append(tr.traj_id))
    assert finished == [1] and inst.take_returned() == [] and inst.times.chunks == 0


def test_a_returned_chunk_keeps_v_traj_and_its_reservation() -> None:
    cluster = SimCluster(_seer(tiny(eta=1, steps=2, seed=0), chunk=50))
    seen_partial = False
    for _ in range(400):
        cluster.step()
        assert cluster.check() == []
        for r in cluster.ts.routing_view():
            if r.v_traj is not None:  # a chunk (or an interrupt) returned it
                seen_partial = True
                assert cluster.ts.state_of(r.traj_id) is TrajState.QUEUED
                assert cluster.manager.group_version(r.group_id) is not None  # still reserved
                assert cluster.manager.group_version(r.group_id) <= r.v_traj
        if cluster.trainer.steps >= 2:
            break
    assert seen_partial and cluster.trainer.steps >= 2
    assert sum(i.times.chunks for i in cluster.instances.values()) > 0


@settings(max_examples=12, deadline=None)
@given(
    eta=st.sampled_from([0, 1, 3]),
    seed=st.integers(0, 50),
    chunk=st.sampled_from([30, 200, 1000]),
    routing=st.sampled_from(["throughput", "vanilla", "sticky"]),
    redundancy=st.sampled_from([0.0, 0.5]),
)
def test_with_seer_the_bound_holds_and_nothing_is_lost(
    eta: int, seed: int, chunk: int, routing: str, redundancy: float
) -> None:
    config = _seer(
        tiny(eta=eta, steps=4, seed=seed).with_(
            batch_redundancy=redundancy, group_redundancy=redundancy
        ),
        chunk=chunk,
        routing=routing,
    )
    cluster = SimCluster(config)
    consumed = run(cluster)  # not stalled, cluster.check() == [] (conservation)
    assert_within_eta(consumed, eta, config.batch_size, config.group_size)
    # every consumed batch was whole (the last may have been consumed as the run ended)
    assert len(cluster.batches) >= 4
    assert len(cluster.consumed) == len(cluster.batches) * config.batch_size * config.group_size


def test_skewed_workloads_with_seer_hold_the_bound_and_report_it() -> None:
    for name in ("bimodal", "outliers", "hetero-0.2"):
        config = _seer(system("staleflow", WORKLOADS[name].config(1, steps=5, small=True)))
        cluster = SimCluster(config)
        consumed = run(cluster)
        assert_within_eta(consumed, 1, config.batch_size, config.group_size)
        summary = summarise(cluster)
        assert summary.chunks > 0 and summary.reprefill_tokens > 0
        assert summary.probe_groups > 0 and 0.0 <= summary.probe_error < 1.0
        assert summary.tail_s >= 0.0


def test_off_by_default_nothing_is_chunked() -> None:
    summary = SimCluster(tiny(eta=1, steps=2)).run()
    assert summary.chunks == 0 and summary.probe_groups == 0


def test_tail_seconds() -> None:
    assert tail_seconds([]) == 0.0
    assert tail_seconds([float(i) for i in range(10)]) == 9.0 - 8.0
    assert tail_seconds([0.0] * 19 + [50.0]) == 50.0


def test_with_the_kv_pool_a_re_placed_chunk_costs_no_prefill() -> None:
    pool: set[int] = set()
    costs = EngineCosts(prefill_s_per_token=1e-3)
    a, b = (SimInstance(i, COST, costs, np.random.default_rng(i), pool=pool) for i in (0, 1))
    empty = (np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32))
    routed = RoutedTrajectory(3, 1, 0, 0, "", np.zeros(10, np.int32), *empty)
    a.submit([SimTrajectory(routed, 10 + 300, a, end=10 + 100)], 0.0)
    a.advance(1e9, lambda *_: None)
    (partial,) = a.take_returned()
    assert pool == {3} and a.times.prefill == pytest.approx(10 * 1e-3)
    again = RoutedTrajectory(
        3, 1, 0, 0, "", np.zeros(10, np.int32), partial.tokens, partial.logprobs, partial.versions
    )
    b.submit([SimTrajectory(again, 10 + 300, b)], a.clock)
    finished: list[int] = []
    b.advance(2e9, lambda _t, _i, tr: finished.append(tr.traj_id))
    assert finished == [3] and b.times.prefill == 0.0 and b.times.reprefill_tokens == 0
    assert pool == set()
