"""Hand-built snapshots and TS contents for the strategy tests."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from coordinator import (
    CoordinatorConfig,
    CostModelConfig,
    InstanceSnapshot,
    Snapshot,
    Strategies,
    TrajRecord,
    build_strategies,
)
from coordinator.cost_model import QWEN3_30B_A3B_H20
from staleness import StalenessConfig, StalenessManager

_ids = itertools.count(1_000_000)

# A small budget makes "full" easy to build by hand; the latency coefficients are Table 4's.
COST = dataclasses.replace(QWEN3_30B_A3B_H20, kv_budget=100_000.0)


def running(lengths: Sequence[int], v_traj: int, group_id: int = -1) -> tuple[TrajRecord, ...]:
    return tuple(TrajRecord(next(_ids), group_id, v_traj, n, min(n, 50)) for n in lengths)


def instance(
    inst: int,
    version: int,
    run: Sequence[int] = (),
    *,
    wait: int = 0,
    complete: int = 0,
    kv: int | None = None,
    v_traj: int | None = None,
) -> InstanceSnapshot:
    """An instance running trajectories of the given lengths (KV = their sum by default)."""
    v = version if v_traj is None else v_traj
    run_trajs = running(run, v)
    return InstanceSnapshot(
        inst=inst,
        kv_cache=sum(run) if kv is None else kv,
        run_trajs=run_trajs,
        wait_trajs=running([100] * wait, v),
        complete_trajs=tuple(next(_ids) for _ in range(complete)),
        inst_version=version,
    )


def snapshot(*instances: InstanceSnapshot) -> Snapshot:
    return Snapshot(tuple(instances))


def initial(group_id: int, size: int = 1, length: int = 100) -> list[TrajRecord]:
    return [TrajRecord(next(_ids), group_id, None, length, length) for _ in range(size)]


def partial(v_traj: int, length: int = 100, group_id: int = -2) -> TrajRecord:
    return TrajRecord(next(_ids), group_id, v_traj, length, min(length, 50))


def manager(version: int, eta: int = 1, batch: int = 4, group: int = 1) -> StalenessManager:
    return StalenessManager(StalenessConfig(eta=eta, batch_size=batch, group_size=group), version)


# The rules beyond the paper, all off: tests of Algorithms 3-5 as the paper writes them use
# these; tests of a new rule switch it on by name.
PAPER_RULES: dict[str, Any] = {
    "estimation": False,
    "fill_steps": None,
    "fresh_admission": False,
    "whole_groups": False,
    "improving_moves": False,
    "critical_speedup": None,
    "pull_kv": None,
}


def config(**overrides: object) -> CoordinatorConfig:
    """A config whose cost model is :data:`COST` (Table 4 with a 100K-token budget), with
    the paper's strategies only (:data:`PAPER_RULES`) unless ``overrides`` say otherwise."""
    fields: dict[str, Any] = {
        "cost_model": CostModelConfig(kv_budget=COST.kv_budget),
        **PAPER_RULES,
        **overrides,
    }
    return CoordinatorConfig(**fields)


def strategies(**overrides: object) -> Strategies:
    return build_strategies(config(**overrides))
