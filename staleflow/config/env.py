"""The ``env`` section: multi-turn environment tasks: the built-in ``data.task=calculator``,
and ``data.task=env`` with any environment (``env.name``: registered, or
``module:attribute``) and its problems from ``data.path``.

A trajectory of such a task is a sequence of model turns and observations; the episode
ends when the environment ends it, at ``env.max_turns`` model turns, or when the response
(turns and observations together) reaches ``rollout.max_response_tokens``
(``staleflow.envs.after_step``: the same rule in every mode), which an environment task
left at its default raises to ``ENV_RESPONSE_TOKENS`` (``RunConfig.resolved``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from staleflow.config.checks import (
    MAX_THREADS,
    MAX_WAIT_S,
    THREADS_WHY,
    WAIT_WHY,
    _help,
    require,
    require_at_least,
)
from staleflow.config.walk import check_types

# data.task values of an environment (staleflow.envs): the built-in calculator with its own
# problems, or env.name with the problems of data.path
ENV_TASKS = ("calculator", "env")
# rollout.max_response_tokens of an environment task left at its default: a calculator
# episode of level 2 takes about 120 tokens (call, answer, final turn); twice that leaves
# room for a retry after a malformed call
ENV_RESPONSE_TOKENS = 256
# model.preset of data.task=calculator left at its default: the micro model learns to copy
# the expression into its call in a few minutes of warm-up on 2 cores, the tiny model in
# about an hour (docs/agentic.md "Learning"). Its 128 positions hold the prompt and a
# response of CALCULATOR_RESPONSE_TOKENS: one solved episode (about 118), no retry.
CALCULATOR_PRESET = "micro"
DEFAULT_PRESET = "tiny"  # model.preset=auto for every other task
CALCULATOR_RESPONSE_TOKENS = 120
# trainer.lr of that model left at its default (5e-5, the tiny model's): measured
# (docs/agentic.md "Learning"), 1e-3 raised held-out success from 0.31 to 0.49 in 200
# steps; 2e-3 collapsed the policy in 10 (success 0.28 -> 0.01, entropy tripled)
CALCULATOR_TRAINER_LR = 1e-3
MAX_TURNS = 1024
TURNS_WHY = "every turn is a round trip through the queue, an instance and a worker"


@dataclass(frozen=True, slots=True)
class EnvConfig:
    """The environment of a multi-turn task, and where its steps run."""

    KEY: ClassVar[str] = "env"

    name: str = field(
        default="",
        metadata=_help(
            "data.task=env: the environment, registered (staleflow.envs.register_environment) "
            "or module:attribute of an Environment class or factory, e.g. mypkg.envs:MyEnv "
            "(importable on every worker)"
        ),
    )
    max_turns: int = field(
        default=4,
        metadata=_help("model turns per trajectory at most", MAX_TURNS, TURNS_WHY),
    )
    latency_scale_s: float = field(
        default=0.05,
        metadata=_help(
            "calculator: the shortest tool call in seconds, the scale of its Pareto "
            "latency; 0 = answers at once",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )
    latency_shape: float = field(
        default=1.5,
        metadata=_help(
            "calculator: the Pareto shape of its latency (smaller: a heavier tail), > 0",
            1000.0,
            "above a few the tail is gone: every call takes about latency_scale_s",
        ),
    )
    latency_cap_s: float = field(
        default=5.0,
        metadata=_help("calculator: the longest tool call in seconds", MAX_WAIT_S, WAIT_WHY),
    )
    step_timeout_s: float = field(
        default=60.0,
        metadata=_help(
            "seconds one environment step may compute (its tool's declared latency not "
            "counted) before its episode ends with env_error; 0 = no limit",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )
    sandbox: bool = field(
        default=False,
        metadata=_help(
            "run each environment step in a child process that is killed past "
            "env.step_timeout_s (untrusted code tools, a step that may loop forever); "
            "false: steps run on the worker's threads and one past its limit is abandoned, "
            "still running"
        ),
    )
    sandbox_memory_mb: int = field(
        default=1024,
        metadata=_help(
            "env.sandbox: the address space (MiB) one step's process may take above what "
            "it starts with (the environment built and imported); past it the step is "
            "stopped and its episode ends with env_error",
            1 << 20,
            "a terabyte: no step needs more",
        ),
    )
    threads: int = field(
        default=8,
        metadata=_help(
            "environment steps a reward worker runs at once (their tools wait side by side)",
            MAX_THREADS,
            THREADS_WHY,
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        module, colon, attr = self.name.partition(":")
        require(
            not colon or bool(module.strip() and attr.strip()),
            "env.name",
            self.name,
            "is not module:attribute: name the module and the class, e.g. mypkg.envs:MyEnv",
        )
        require_at_least("env.max_turns", self.max_turns, 1, "turn")
        require_at_least("env.threads", self.threads, 1, "thread")
        require_at_least("env.sandbox_memory_mb", self.sandbox_memory_mb, 16, "MiB")
        require(
            math.isfinite(self.latency_scale_s) and self.latency_scale_s >= 0,
            "env.latency_scale_s",
            self.latency_scale_s,
            "must be >= 0 seconds (0: no wait), e.g. 0.05",
        )
        require(
            math.isfinite(self.step_timeout_s) and self.step_timeout_s >= 0,
            "env.step_timeout_s",
            self.step_timeout_s,
            "must be >= 0 seconds (0: no limit), e.g. 60",
        )
        require(
            not self.sandbox or self.step_timeout_s > 0,
            "env.step_timeout_s",
            self.step_timeout_s,
            "must be > 0 with env.sandbox=true: it is the limit past which a step's process "
            "is killed, e.g. 60",
        )
        require(
            math.isfinite(self.latency_shape) and self.latency_shape > 0,
            "env.latency_shape",
            self.latency_shape,
            "must be > 0, e.g. 1.5",
        )
        require(
            math.isfinite(self.latency_cap_s) and self.latency_cap_s >= self.latency_scale_s,
            "env.latency_cap_s",
            self.latency_cap_s,
            f"must be >= env.latency_scale_s={self.latency_scale_s}, e.g. 5",
        )

    def environment(self, task: str) -> str:
        """The environment ``data.task`` runs: the built-in calculator, or ``env.name``."""
        return self.name if task == "env" else task

    def options(self, environment: str) -> dict[str, Any]:
        """What ``staleflow.envs.make_environment(environment, ...)`` takes from this
        section: the calculator's latency; nothing for another environment, which is built
        with its defaults."""
        if environment == "calculator":
            return {
                "latency_scale_s": self.latency_scale_s,
                "latency_shape": self.latency_shape,
                "latency_cap_s": self.latency_cap_s,
            }
        return {}
