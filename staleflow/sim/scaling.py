"""Scaled variants of a simulated cluster for Figure 15 (one factor at a time)."""

from __future__ import annotations

from dataclasses import replace

from staleflow.sim.cluster import ClusterConfig

DIMENSIONS = ("response", "batch", "gpus")


def scale(config: ClusterConfig, dimension: str, factor: float) -> ClusterConfig:
    """``config`` with one factor multiplied by ``factor``.

    - ``response``: the response length cap (the workload's lengths scale with it).
    - ``batch``: the batch size (groups per training step).
    - ``gpus``: rollout instances and training GPUs together, so the rollout/training split
      stays as in the preset; the trainer's time per token divides by ``factor``.
    """
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    if dimension == "response":
        w = config.workload
        return config.with_(workload=replace(w, max_response=_at_least_1(w.max_response * factor)))
    if dimension == "batch":
        return config.with_(batch_size=_at_least_1(config.batch_size * factor))
    if dimension == "gpus":
        return config.with_(
            instances=_at_least_1(config.instances * factor),
            trainer=config.trainer.sped_up(factor),
        )
    raise ValueError(f"unknown dimension {dimension!r}: use one of {DIMENSIONS}")


def value(config: ClusterConfig, dimension: str) -> int:
    """The scaled quantity, for tables and axes: the response cap, the batch size, or the
    GPUs: one per rollout instance plus as many training GPUs (the split of both presets,
    ``Layout()``'s 64 + 64 for ``paper-6.5``)."""
    if dimension == "response":
        return config.workload.max_response
    if dimension == "batch":
        return config.batch_size
    return 2 * config.instances


def _at_least_1(x: float) -> int:
    return max(1, round(x))
