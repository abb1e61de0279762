"""Held-out evaluation of the policy before and after a run (built-in task only).

The per-step ``rollout/reward_mean`` mixes problems of different difficulty, 8 prompts at a
time, and arrives in bursts; whether the policy improved is better answered on a fixed set
of problems that neither the warm-up nor the run trains on, sampled the way the rollout
samples. The driver runs it on the initial weights and on the final checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from staleflow.data.synthetic import ArithmeticConfig, ArithmeticTask
from staleflow.progress import SILENT, Progress

if TYPE_CHECKING:
    from staleflow.config import RunConfig

logger = logging.getLogger(__name__)

# Offset of the held-out problem stream from the run's seed; the warm-up uses seed and the
# run's prompts seed + 1 (launch.build_dataset), so this stream shares neither prefix.
EVAL_SEED_OFFSET = 1_000_003


def held_out_reward(
    cfg: RunConfig, model: Any, tokenizer: Any, progress: Progress = SILENT, which: str = "initial"
) -> float | None:
    """Mean reward of ``model`` on ``cfg.eval_problems`` held-out problems of the built-in
    task, one response each at ``rollout.temperature``; None when there is nothing to
    evaluate (``eval_problems=0`` or a dataset task, which has no held-out split here).
    ``progress`` gets a ``scoring`` phase counting problems; ``which`` names the policy
    in its label (initial, final)."""
    if cfg.eval_problems <= 0 or cfg.data.task != "arithmetic":
        return None
    # torch: loaded only when the driver evaluates a model, not when launch imports this
    from staleflow.models.sampling import evaluate_accuracy
    from staleflow.models.threads import idle_cores, torch_threads

    task = ArithmeticTask(
        ArithmeticConfig.level(cfg.data.difficulty, seed=cfg.seed + EVAL_SEED_OFFSET)
    )
    with (
        progress.phase(
            "scoring",
            f"scoring the {which} policy on held-out problems",
            total=cfg.eval_problems,
            unit="problems",
        ) as phase,
        torch_threads(idle_cores()),
    ):
        reward = evaluate_accuracy(
            model,
            tokenizer,
            task,
            cfg.eval_problems,
            cfg.rollout.temperature,
            seed=cfg.seed,
            max_new_tokens=cfg.rollout.max_response_tokens,
            on_batch=phase.advance,
        )
        phase.update(reward=reward)
    return reward
