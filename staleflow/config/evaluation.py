"""The ``eval`` section: the held-out set and how often the policy is scored on it.

One held-out set serves both evaluations: the score of the initial policy and of the
final checkpoint (the built-in task only, on a CPU copy in the driver), and the
evaluation during training, every ``eval.every`` steps on the rollout engines
(``docs/evaluation.md``). The set is ``eval.path`` read as ``data`` reads its prompts
(the same loaders, column mapping and chat template), or, for the built-in arithmetic
task, its own held-out problem stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from staleflow.config.checks import INT32_MAX, STEPS_WHY, _help, require, require_at_least
from staleflow.config.walk import check_types

MAX_PROBLEMS = 2**20
PROBLEMS_WHY = (
    "each is sampled eval.samples times per evaluation: 2**20 takes hours on the embedded engine"
)
MAX_SAMPLES = 1024
SAMPLES_WHY = "responses per problem: pass@k is reported for k up to 1024"
MAX_RUNNING = 65536
RUNNING_WHY = "requests in one engine's batch: no engine runs more at once"


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """The held-out set, and the evaluation during training on the rollout engines."""

    KEY: ClassVar[str] = "eval"

    path: str = field(
        default="",
        metadata=_help(
            "the held-out set: a .jsonl / .parquet file, or a Hugging Face datasets folder "
            "or files (read like data.path, with data.prompt_column, data.answer_column and "
            "data.chat_template); '' = the built-in task's own held-out problems"
        ),
    )
    split: str = field(
        default="test",
        metadata=_help("the split a datasets folder of eval.path is read from"),
    )
    every: int = field(
        default=0,
        metadata=_help(
            "evaluate during training after every N-th step, on the rollout engines at "
            "their current policy version; 0 = off",
            INT32_MAX,
            STEPS_WHY,
        ),
    )
    samples: int = field(
        default=4,
        metadata=_help(
            "responses per held-out problem in an evaluation during training (for mean@k "
            "and pass@k)",
            MAX_SAMPLES,
            SAMPLES_WHY,
        ),
    )
    pass_k: int = field(
        default=0,
        metadata=_help(
            "the k of pass@k, at most eval.samples (unbiased estimator over the samples); "
            "0 = eval.samples",
            MAX_SAMPLES,
            SAMPLES_WHY,
        ),
    )
    problems: int = field(
        default=512,
        metadata=_help(
            "held-out problems scored per evaluation (the first N of the set); the built-in "
            "task also scores the initial and final policy on them; 0 = no evaluation",
            MAX_PROBLEMS,
            PROBLEMS_WHY,
        ),
    )
    max_running: int = field(
        default=16,
        metadata=_help(
            "evaluation responses generating at once on one rollout instance; the rest wait "
            "on that instance, so training trajectories keep the rest of its batch",
            MAX_RUNNING,
            RUNNING_WHY,
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require(
            self.every >= 0,
            "eval.every",
            self.every,
            "is negative: use N >= 1 (evaluate after every N-th step), or 0 for no evaluation",
        )
        require_at_least("eval.samples", self.samples, 1, "response per problem")
        require_at_least("eval.problems", self.problems, 0, "problems (0 = no evaluation)")
        require_at_least("eval.max_running", self.max_running, 1, "request per instance")
        require(
            0 <= self.pass_k <= self.samples,
            "eval.pass_k",
            self.pass_k,
            f"is out of range: use 1 to eval.samples={self.samples} (0 = eval.samples): "
            "pass@k needs at least k responses per problem",
        )
        require(bool(self.split), "eval.split", self.split, "is empty: use e.g. test")
        require(
            not (self.every > 0 and self.problems == 0),
            "eval.problems",
            self.problems,
            f"leaves nothing to evaluate every {self.every} steps: set eval.problems >= 1, "
            "or eval.every=0",
        )

    @property
    def k(self) -> int:
        """The k of pass@k."""
        return self.pass_k or self.samples

    @property
    def during_training(self) -> bool:
        return self.every > 0 and self.problems > 0
