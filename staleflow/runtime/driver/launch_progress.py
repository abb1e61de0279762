"""The phases ``staleflow launch`` reports once its actors run: the first buffer (groups of
the first batch rewarded, until its training step) and the training itself (steps, reward,
time left), fed from the launcher's poll of the control plane (see ``staleflow.progress``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from staleflow.progress import SILENT, Phase, Progress

if TYPE_CHECKING:
    from staleflow.runfolder.step_record import StepRecord
    from staleflow.runtime.controller.plane_records import LiveState
    from staleness import StalenessConfig

# The pools Run.start builds, in order (Figure 6); it advances the phase once per pool.
ACTOR_STAGES = ("control + TS", "PS", "reward", "rollout", "trainer")


def actors_phase(
    progress: Progress, instances: int, reward_workers: int, ps_replicas: int
) -> Phase:
    """The ``actors`` phase of a run of ``instances`` rollout instances
    (``rollout.instances``) and ``reward_workers`` (``reward.workers``): ``Run.start``
    advances it once per pool it has started."""
    return progress.phase(
        "actors",
        f"starting actors: {instances} rollout, {reward_workers} reward, "
        f"trainer, TS, {ps_replicas} PS, control",
        total=len(ACTOR_STAGES),
        unit="stages",
    )


def first_buffer_groups(live: LiveState) -> int:
    """Groups occupied in the buffer the trainer waits for (a ``LiveState``)."""
    view = live.buffers
    return sum(
        e.kind == "occupied" for b in view.buffers if b.version == view.version for e in b.entries
    )


class TrainingWaits:
    """Opens ``training`` (steps, reward, time left) and ``first_buffer`` on entry, ends
    ``first_buffer`` at the first step's record, and finishes both on exit (as failed
    when the run raised), for a run of ``steps`` steps under the ``staleness`` protocol
    (its ``eta`` and ``batch_size``)."""

    def __init__(
        self,
        progress: Progress,
        staleness: StalenessConfig,
        steps: int,
        on_tick: Callable[[Any], None] | None = None,
    ) -> None:
        self._progress = progress
        self._eta, self._batch_size, self._steps = staleness.eta, staleness.batch_size, steps
        self._on_tick = on_tick
        self._first: Phase | None = None
        self._training: Phase | None = None

    def __enter__(self) -> TrainingWaits:
        self._training = self._progress.phase(
            "training", f"training with eta={self._eta}", total=self._steps, unit="steps"
        )
        self._first = self._progress.phase(
            "first_buffer", "waiting for the first buffer", total=self._batch_size, unit="groups"
        )
        return self

    def on_tick(self) -> Callable[[Any], None] | None:
        """What the launcher's poll should call with the live state: :meth:`tick`, or
        None (no polling) when neither the progress nor the caller wants it."""
        wanted = self._on_tick is not None or self._progress is not SILENT
        return self.tick if wanted else None

    def tick(self, live: LiveState | None) -> None:
        """The control plane's live state (every poll); passed on to ``on_tick``."""
        if self._first is not None and live is not None:
            groups = first_buffer_groups(live)
            detail = "the trainer takes its first step" if groups >= self._batch_size else ""
            self._first.update(done=groups, detail=detail, rewarded=live.rewarded)
        if self._on_tick is not None:
            self._on_tick(live)

    def record(self, rec: StepRecord) -> None:
        """A training step's record."""
        if self._first is not None:
            self._first.update(done=self._batch_size)
            self._first.finish()
            self._first = None
        if self._training is not None:
            reward = rec.reward_mean
            metrics = {} if reward is None else {"reward": reward}
            self._training.update(done=rec.step, **metrics)

    def __exit__(self, *exc: object) -> None:
        for phase in (self._first, self._training):
            if phase is not None:
                phase.__exit__(*exc)
