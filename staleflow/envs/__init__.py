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
from staleflow.envs.verifiers_env import VerifiersEnvironment, is_verifiers_taskset

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


def environment_target(name: str) -> str:
    """The ``"module:attribute"`` of ``name``: a registered name's target, or ``name``
    itself when it is ``"module:attribute"`` (an environment that is not registered).
    Workers build the environment from the target, so a name registered in the driver's
    process only is found there too."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, sep, attr = name.partition(":")
    if module and sep and attr:
        return name
    raise ValueError(
        f"unknown environment {name!r}; use one of {', '.join(sorted(ENVIRONMENTS))}, "
        "'module:attribute' of your Environment class (e.g. env.name=mypkg.envs:MyEnv), or "
        "add yours with staleflow.envs.register_environment"
    )


def make_environment(name: str, **options: object) -> Environment:
    """The environment ``name`` (registered, or ``"module:attribute"``) built with
    ``options``; imported here. The attribute is a class or factory, called with
    ``options``, or an :class:`Environment` object itself (then without options), or a
    ``verifiers`` Taskset class or object, run by :mod:`staleflow.envs.verifiers_env`.

    Raises ValueError (an unknown name), ImportError (the module or attribute is not
    there) or :class:`EnvContractError` (what it names is not an environment, or its
    constructor failed), each naming the fix."""
    target = environment_target(name)
    shown = name if name == target else f"{name!r} ({target})"
    module, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"environment {shown} could not be loaded: {exc}; the module must be importable "
            "where the run starts and on every worker (installed, or on PYTHONPATH)"
        ) from exc
    if is_verifiers_taskset(factory):  # a `verifiers` environment: its adapter runs it
        if options:
            raise EnvContractError(f"environment {shown} is a verifiers taskset: no options")
        try:
            return VerifiersEnvironment(factory)
        except EnvContractError:
            raise
        except Exception as exc:
            raise EnvContractError(
                f"environment {shown} (a verifiers taskset) could not be adapted: {exc!r}"
            ) from exc
    if isinstance(factory, Environment) and not isinstance(factory, type):
        if options:
            raise EnvContractError(
                f"environment {shown} is an object, which takes no options ({sorted(options)})"
            )
        return factory
    if not callable(factory):
        raise EnvContractError(
            f"environment {shown} is a {type(factory).__name__}: name a class or factory "
            "that builds an Environment (staleflow.envs.base.Environment)"
        )
    try:
        env = factory(**options)
    except Exception as exc:  # a constructor that cannot run: say whose, and with what
        raise EnvContractError(
            f"environment {shown} could not be built with {options or 'no options'}: {exc!r}"
        ) from exc
    if not isinstance(env, Environment):
        raise EnvContractError(
            f"environment {shown} built a {type(env).__name__}, which lacks name, start, "
            "step or score (staleflow.envs.base.Environment)"
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
    "environment_target",
    "keyed_uniform",
    "make_environment",
    "register_environment",
]
