"""Which step records wait for their held-out evaluation (``eval.every``).

After every ``every``-th training step the record of that step is held back: the driver
sees the step is due (:meth:`EvalHold.due`), evaluates the policy on the rollout engines
(``staleflow.runtime.driver.eval_rounds``) and hands the scores back
(:meth:`EvalHold.done`), which go into that record before it and the records after it
are published, in order. Training goes on meanwhile; only the records wait.

One evaluation runs at a time, and one more step may wait for its turn: a step due while
one runs and another waits takes the waiting one's place (that one is skipped, logged).
So the records lag at most two evaluations behind, and the last step due is always
evaluated.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from staleflow.rewards.estimators import EvalScores
from staleflow.runfolder.step_record import StepRecord

logger = logging.getLogger(__name__)


class EvalHold:
    """Not thread-safe: the control loop's thread changes it, readers take its ints."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.held: list[int] = []  # steps whose records wait: the one evaluated, the next
        self.skipped = 0

    def before_step(self, step: int) -> None:
        """Step ``step`` (1-based) is about to be recorded: hold its record if it is due."""
        if self.every <= 0 or step % self.every:
            return
        if len(self.held) < 2:
            self.held.append(step)
            return
        self.skipped += 1
        logger.warning(
            "evaluation of step %d skipped for step %d's: the one of step %d still runs "
            "(raise eval.every or eval.max_running, or lower eval.problems or eval.samples)",
            self.held[1],
            step,
            self.held[0],
        )
        self.held[1] = step

    def published(self, recorded: int) -> int:
        """How many of ``recorded`` records may be read: those before the first held."""
        return min(recorded, self.held[0] - 1) if self.held else recorded

    def due(self, recorded: int) -> int | None:
        """The step to evaluate now, once its record exists."""
        return self.held[0] if self.held and self.held[0] <= recorded else None

    def done(self, records: list[StepRecord], step: int, scores: EvalScores | None) -> bool:
        """The evaluation of ``step`` ended (``scores`` None: it could not be taken, e.g.
        every instance was lost): put its scores into that record and let it out. False
        for a step that is not the one due (the message came late, or twice)."""
        if not self.held or self.held[0] != step or len(records) < step:
            return False
        if scores is not None:
            records[step - 1] = with_scores(records[step - 1], scores)
        self.held.pop(0)
        return True


def with_scores(rec: StepRecord, scores: EvalScores) -> StepRecord:
    """``rec`` with the evaluation's fields."""
    return replace(
        rec,
        eval_mean_at_k=scores.mean_at_k,
        eval_pass_at_k=scores.pass_at_k,
        eval_k=scores.k,
        eval_samples=scores.samples,
        eval_problems=scores.problems,
        eval_version=scores.version_min,
        eval_version_max=scores.version_max,
        eval_s=scores.seconds,
    )
