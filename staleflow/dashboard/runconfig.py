"""What the dashboard reads from a run's configuration: the cost model the coordinator
plans with (for per-instance throughput estimates) and the saved ``config.yaml``."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from coordinator.cost_model import CostModel, learned_speculation
from staleflow.config import RunConfig, config_from_dict
from staleflow.runfolder.reader import read_config
from staleflow.runfolder.step_record import StepRecord, speculation_counts

logger = logging.getLogger(__name__)


def cost_model_of(cfg: RunConfig) -> CostModel:
    """The cost model of a :class:`~staleflow.config.RunConfig` as the coordinator starts
    with it: the engines' KV budget when the config leaves it open (as ``staleflow
    launch`` does) and ``rollout.speculation``'s prior."""
    cost = cfg.coordinator.cost_model
    if cost.kv_budget is None:
        cost = replace(cost, kv_budget=float(cfg.rollout.kv_budget_tokens))
    return cost.build().with_speculation(cfg.rollout.speculation.profile())


def cost_model_at(cost: CostModel | None, last: StepRecord | None) -> CostModel | None:
    """``cost`` as the coordinator plans with it after ``last``: with speculation on,
    the acceptance learned from the engines' counters so far (``ControlLoop``'s rule)."""
    if cost is None or cost.speculation is None or last is None:
        return cost
    counts = speculation_counts(last.extra)
    if counts is None:
        return cost
    return cost.with_speculation(learned_speculation(cost.speculation, *counts))


def read_run_config(folder: Path) -> tuple[dict[str, Any], CostModel | None, str]:
    """(raw ``config.yaml``, its cost model or None, a note when either is unknown)."""
    raw, problem = read_config(folder)
    if raw is None:
        return {}, None, f"{problem}: run settings and cost model unknown"
    try:
        return raw, cost_model_of(config_from_dict(raw)), ""
    except Exception as exc:  # an older or newer config: still show the rest
        logger.debug("config.yaml of %s does not load", folder, exc_info=True)
        return raw, None, f"cost model unknown: config.yaml does not load ({exc})"
