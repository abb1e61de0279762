"""Trainers: the embedded PyTorch trainer, the Megatron-core rank pool, and the registry
the launcher picks from (``trainer.backend``).

Both run the one RL step of :mod:`staleflow.trainers.rl`. Importing this package does not
import torch or megatron-core; :func:`create_trainer` imports the chosen backend on demand.
"""

from __future__ import annotations

import importlib

from staleflow.trainers.interface import METRIC_KEYS, StreamingTrainer, Trainer

TRAINERS: dict[str, str] = {
    "embedded": "staleflow.trainers.embedded:EmbeddedTrainer",
    "megatron": "staleflow.trainers.megatron.pool:MegatronTrainer",
}


def trainer_class(name: str) -> type:
    """The trainer class registered under ``name`` (imported now)."""
    try:
        target = TRAINERS[name]
    except KeyError:
        raise ValueError(f"unknown trainer {name!r}; use one of {sorted(TRAINERS)}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def create_trainer(name: str, *args: object, **kwargs: object) -> Trainer:
    return trainer_class(name)(*args, **kwargs)


__all__ = [
    "METRIC_KEYS",
    "TRAINERS",
    "StreamingTrainer",
    "Trainer",
    "create_trainer",
    "trainer_class",
]
