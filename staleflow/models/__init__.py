"""Offline policies: small Qwen2 models built from code, local Hugging Face checkpoints,
the named weights the parameter server carries, and the supervised warm-up.

Presets and errors import without torch; everything else is imported on first use, so
that configuration code can list presets on a machine without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from staleflow.models.errors import ModelError
from staleflow.models.presets import PRESETS, ModelPreset, get_preset

_LAZY = {
    "arithmetic_tokenizer": "staleflow.models.build",
    "build_arithmetic_model": "staleflow.models.build",
    "build_model": "staleflow.models.build",
    "qwen2_config": "staleflow.models.build",
    "load_pretrained": "staleflow.models.checkpoint",
    "save_pretrained": "staleflow.models.checkpoint",
    "load_policy_state": "staleflow.models.state",
    "policy_state": "staleflow.models.state",
    "default_task_config": "staleflow.models.warmup",
    "ensure_warm_checkpoint": "staleflow.models.warmup",
    "ensure_warm_model": "staleflow.models.warmup",
    "evaluate_accuracy": "staleflow.models.sampling",
    "sample_responses": "staleflow.models.sampling",
    "warmup": "staleflow.models.warmup",
}

if TYPE_CHECKING:
    from staleflow.models.build import (
        arithmetic_tokenizer,
        build_arithmetic_model,
        build_model,
        qwen2_config,
    )
    from staleflow.models.checkpoint import load_pretrained, save_pretrained
    from staleflow.models.sampling import evaluate_accuracy, sample_responses
    from staleflow.models.state import load_policy_state, policy_state
    from staleflow.models.warmup import (
        default_task_config,
        ensure_warm_checkpoint,
        ensure_warm_model,
        warmup,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'staleflow.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "PRESETS",
    "ModelError",
    "ModelPreset",
    "arithmetic_tokenizer",
    "build_arithmetic_model",
    "build_model",
    "default_task_config",
    "ensure_warm_checkpoint",
    "ensure_warm_model",
    "evaluate_accuracy",
    "get_preset",
    "load_policy_state",
    "load_pretrained",
    "policy_state",
    "qwen2_config",
    "sample_responses",
    "save_pretrained",
    "warmup",
]
