"""Reward functions chosen by name, imported only when asked for (``math_verify`` pulls
in sympy and ANTLR, which a run of the arithmetic task never needs)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from staleflow.rewards.base import RewardFn

REWARD_NAMES: tuple[str, ...] = ("arithmetic", "exact", "math_verify")
AUTO = "auto"


@dataclass(frozen=True, slots=True)
class RewardSpec:
    """factory: ``"module:attr"`` of a callable that returns a :class:`RewardFn` when
    called with the function's options. may_hang: the function can run for unbounded time
    on adversarial text (symbolic maths), so the worker isolates it in a child process
    it can kill when a time limit is set."""

    factory: str
    may_hang: bool = False


_REGISTRY: dict[str, RewardSpec] = {
    "arithmetic": RewardSpec("staleflow.rewards.simple:make_arithmetic"),
    "exact": RewardSpec("staleflow.rewards.simple:make_exact"),
    "math_verify": RewardSpec("staleflow.rewards.mathverify:MathVerifyReward", may_hang=True),
}


def register_reward(name: str, factory: str, *, may_hang: bool = False) -> None:
    """Add a reward function under ``name`` (``factory`` as in :class:`RewardSpec`)."""
    if ":" not in factory:
        raise ValueError(f"reward factory {factory!r} must be 'module:attr'")
    _REGISTRY[name] = RewardSpec(factory, may_hang)


def reward_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def reward_spec(name: str) -> RewardSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown reward function {name!r}; use one of {', '.join(_REGISTRY)}"
        ) from None


def load_factory(factory: str) -> Callable[..., RewardFn]:
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_reward_fn(name: str, **options: object) -> RewardFn:
    """The reward function registered as ``name``, built in this process."""
    return load_factory(reward_spec(name).factory)(**options)


def resolve_reward_kind(kind: str, task: str) -> str:
    """``auto`` -> ``arithmetic`` for the built-in task, ``math_verify`` for datasets
    (GSM8K, DAPO-Math and local files, whose answers are numbers or LaTeX), ``exact`` for
    an environment task (``calculator``, ``env``), which its environment scores instead."""
    if kind != AUTO:
        return kind
    # an environment task (staleflow.config.env.ENV_TASKS, not imported: the config
    # imports this module): its environment scores the episode
    if task in ("calculator", "env"):
        return "exact"
    return "arithmetic" if task == "arithmetic" else "math_verify"
