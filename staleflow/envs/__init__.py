"""Multi-turn environments behind one contract (:mod:`staleflow.envs.base`), by name.

The registry maps names to ``"module:attribute"`` and imports an environment only when
asked, as the engines' and trainers' registries do, so importing this package costs
nothing of any environment's dependencies.
"""

from __future__ import annotations

import importlib

from staleflow.envs.base import (
    FINISH_DONE,
    FINISH_ERROR,
    FINISH_MAX_TOKENS,
    FINISH_MAX_TURNS,
    TRUNCATIONS,
    EnvContractError,
    Environment,
    EnvSample,
    EnvState,
    Episode,
    EpisodeLimits,
    ModelTurn,
    Step,
    Verdict,
    after_step,
    check_plain,
    keyed_uniform,
)

# name -> "module:attribute" of a class (or factory) called with the environment's options
ENVIRONMENTS: dict[str, str] = {
    "calculator": "staleflow.envs.calculator:CalculatorEnvironment",
}


def register_environment(name: str, target: str) -> None:
    """Add an environment under ``name``; ``target`` is ``"module:attribute"``."""
    module, sep, attr = target.partition(":")
    if not (name and module and sep and attr):
        raise ValueError(f"environment {name!r}: target {target!r} must be 'module:attribute'")
    ENVIRONMENTS[name] = target


def environment_names() -> tuple[str, ...]:
    return tuple(ENVIRONMENTS)


def make_environment(name: str, **options: object) -> Environment:
    """The environment registered as ``name``, built with ``options``; imported here."""
    if name not in ENVIRONMENTS:
        raise ValueError(
            f"unknown environment {name!r}; use one of {', '.join(sorted(ENVIRONMENTS))} "
            "or add yours with staleflow.envs.register_environment"
        )
    module, _, attr = ENVIRONMENTS[name].partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"environment {name!r} ({ENVIRONMENTS[name]}) could not be loaded: {exc}"
        ) from exc
    env = factory(**options)
    if not isinstance(env, Environment):
        raise EnvContractError(
            f"environment {name!r}: {ENVIRONMENTS[name]} built a {type(env).__name__}, "
            "which lacks name, start, step or score (staleflow.envs.base.Environment)"
        )
    return env


__all__ = [
    "ENVIRONMENTS",
    "FINISH_DONE",
    "FINISH_ERROR",
    "FINISH_MAX_TOKENS",
    "FINISH_MAX_TURNS",
    "TRUNCATIONS",
    "EnvContractError",
    "EnvSample",
    "EnvState",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "ModelTurn",
    "Step",
    "Verdict",
    "after_step",
    "check_plain",
    "environment_names",
    "keyed_uniform",
    "make_environment",
    "register_environment",
]
