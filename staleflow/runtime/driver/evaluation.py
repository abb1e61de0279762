"""The run's held-out set (the ``eval`` section), and the score of the policy on it before
and after the run (built-in tasks only: arithmetic, and the calculator's episodes).

The per-step ``rollout/reward_mean`` mixes problems of different difficulty, 8 prompts at a
time, and arrives in bursts; whether the policy improved is better answered on a fixed set
of problems that neither the warm-up nor the run trains on, sampled the way the rollout
samples. The set is ``eval.path`` (read by the loaders and rules of ``data``), or the
built-in task's own held-out stream; the evaluation during training samples it on the
rollout engines (``staleflow.runtime.driver.eval_rounds``), and for the built-in task
the driver also scores the initial weights and the final checkpoint on it, on a CPU copy.
For the calculator task that score is the share of held-out episodes solved, each played
turn by turn against the environment (``staleflow.models.tool_warmup.play_episodes``,
the player of the warm-up's validation) and scored by it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from staleflow.data.datasets import PromptFormat
from staleflow.data.heldout import (
    EVAL_SEED_OFFSET,
    builtin_heldout,
    check_heldout_source,
    load_heldout,
)
from staleflow.data.synthetic import ArithmeticConfig, ArithmeticTask
from staleflow.envs.base import EpisodeLimits
from staleflow.envs.formats import turn_format
from staleflow.progress import SILENT, Progress
from staleflow.runtime.driver.env_task import calculator_heldout, task_environment

if TYPE_CHECKING:
    from torch import nn

    from staleflow.config import RolloutConfig
    from staleflow.data import PromptDataset
    from staleflow.data.tokenizer import Tokenizer
    from staleflow.runtime.driver.run_plan import TaskPlan

__all__ = ["EVAL_SEED_OFFSET", "check_heldout", "held_out_reward", "heldout_set"]

logger = logging.getLogger(__name__)


def check_heldout(task: TaskPlan) -> None:
    """``eval.path`` is there and has the prompt and answer columns (``DatasetError``
    otherwise); the calculator task's level holds a problem outside the run's own
    (``LaunchError`` otherwise, before the warm-up and Ray); nothing else to check."""
    if task.eval.problems <= 0:
        return
    if task.eval.path:
        check_heldout_source(task.eval.path, task.data.record_layout(), task.eval.split)
    elif task.data.task == "calculator":
        calculator_heldout(task, 1)


def heldout_set(task: TaskPlan, tokenizer: Tokenizer) -> PromptDataset | None:
    """The first ``eval.problems`` problems of the held-out set as the rollout gets its
    prompts (same layout and chat template); None when the run evaluates nothing during
    training. Raises ``DatasetError`` naming what is wrong."""
    ev, data = task.eval, task.data
    if not ev.during_training:
        return None
    if not ev.path:  # only the built-in task gets here (RunConfig checks it)
        return builtin_heldout(tokenizer, data.difficulty, task.seed, ev.problems)
    fmt = PromptFormat(data.chat_template, data.system_prompt)
    return load_heldout(
        ev.path, tokenizer, data.record_layout(), fmt, ev.split, problems=ev.problems
    )


def held_out_reward(
    task: TaskPlan,
    rollout: RolloutConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    progress: Progress = SILENT,
    which: str = "initial",
) -> float | None:
    """Mean reward of ``model`` on ``eval.problems`` held-out problems of the built-in
    task, one response each at ``rollout.temperature`` (of the resolved ``rollout``
    section), or its :func:`held_out_success` for the calculator task; None when there is nothing to
    evaluate (``eval.problems=0``, or a task other than the built-in one, whose policy
    would take too long on a CPU copy: evaluate it during training instead, ``eval.every``).
    ``progress`` gets a ``scoring`` phase counting problems; ``which`` names the policy
    in its label (initial, final)."""
    problems = task.eval.problems
    if problems <= 0 or task.eval.path:
        return None
    if task.data.task == "calculator":
        return held_out_success(task, rollout, model, tokenizer, progress, which)
    if task.data.task != "arithmetic":
        return None
    # torch: loaded only when the driver evaluates a model, not when launch imports this
    from staleflow.models.sampling import evaluate_accuracy
    from staleflow.models.threads import idle_cores, torch_threads

    # the problems builtin_heldout tokenises for the evaluation during training
    stream = ArithmeticTask(
        ArithmeticConfig.level(task.data.difficulty, seed=task.seed + EVAL_SEED_OFFSET)
    )
    with (
        progress.phase(
            "scoring",
            f"scoring the {which} policy on held-out problems",
            total=problems,
            unit="problems",
        ) as phase,
        torch_threads(idle_cores()),
    ):
        reward = evaluate_accuracy(
            model,
            tokenizer,
            stream,
            problems,
            rollout.temperature,
            seed=task.seed,
            max_new_tokens=rollout.max_response_tokens,
            on_batch=phase.advance,
        )
        phase.update(reward=reward)
    return reward


def held_out_success(
    task: TaskPlan,
    rollout: RolloutConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    progress: Progress = SILENT,
    which: str = "initial",
) -> float:
    """The share of ``eval.problems`` held-out calculator episodes (disjoint from the
    run's samples: ``env_task.calculator_heldout``) that ``model`` solves, each played
    against the environment as the run plays it (the run's turn format, ``env.max_turns``
    and ``rollout.max_response_tokens``, at ``rollout.temperature``; the tool answers
    at once: its latency is no part of the score), seeded by the run's seed."""
    # torch: as above
    from staleflow.models.tool_warmup import success_rate

    samples = calculator_heldout(task, task.eval.problems)
    env = task_environment(task)  # play_episodes never waits a tool's latency
    limits = EpisodeLimits(task.env.max_turns, rollout.max_response_tokens)
    with progress.phase(
        "scoring",
        f"playing the {which} policy's held-out calculator episodes",
        total=len(samples),
        unit="episodes",
    ) as phase:
        success = success_rate(
            model,
            env,
            turn_format(tokenizer),
            samples,
            limits,
            temperature=rollout.temperature,
            seed=task.seed,
        )
        phase.update(done=len(samples), reward=success)
    return success
