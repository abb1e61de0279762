"""Rollout engines behind one contract (:mod:`staleflow.engines.base`), looked up by name.

The registry maps backend names to dotted paths and imports a backend only when asked, so
importing this package pulls in neither torch nor any GPU stack.
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
    StepTimes,
)

# name -> "module:attribute"; None marks a reserved name with no implementation yet.
BACKENDS: dict[str, str | None] = {
    "embedded": "staleflow.engines.embedded:EmbeddedEngine",
    "sglang": None,
}

_RESERVED = {
    "sglang": (
        "the 'sglang' rollout backend needs the sglang extra (pip install -e '.[sglang]') "
        "and is not implemented yet; use backend 'embedded'"
    ),
}


def engine_class(name: str) -> type:
    """The engine class registered as ``name``, imported on first use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; choose one of {sorted(BACKENDS)}")
    path = BACKENDS[name]
    if path is None:
        raise NotImplementedError(_RESERVED[name])
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        from staleflow.install import install_command

        # the embedded engine's torch comes with the default install; others with their extra
        fix = install_command("" if name == "embedded" else name)
        raise ImportError(
            f"rollout backend {name!r} could not be imported ({exc}); install it with: {fix}"
        ) from exc


__all__ = [
    "BACKENDS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "EngineOutput",
    "EngineState",
    "GenerationRequest",
    "RolloutEngine",
    "StepTimes",
    "engine_class",
]
