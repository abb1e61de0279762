"""Dynamic sampling (DAPO, Yu et al. 2025, §3.2; verl's ``algorithm.filter_groups``):
drop a completed group whose rewards are all equal, and keep the batch full.

Every group-relative advantage (``staleflow.trainers.losses.group_advantages``: GRPO,
DAPO, Dr. GRPO) is exactly zero for such a group, so it adds tokens to the batch and
nothing to the gradient. The decision is :func:`has_signal`, the trainer's own test: at
least two graded rewards (a trajectory whose reward function failed is left out of its
group's advantages, and here) and not all of them equal.

**Where it runs.** In the control loop, at the Occupy of the group's ``G``-th
trajectory: its rewards are all known then and the trainer has not seen it. The loop
hands :meth:`DynamicSampling.keeps` to the staleness manager's ``complete(keep=...)``,
which filters the group inside the same locked call (§4.3, Figure 8c: occupied groups of
later buffers move forward into the hole and the freed entry takes a new Reserve), so no
reader, a streaming trainer included, ever sees it occupied. The trajectory server drops
the group as *filtered* (``TrajectoryServer.filter_group``), which the audit counts
apart from aborts.

**The budget.** At most ``budget`` groups are filtered between two Consumes
(``SamplingConfig.max_drop``: the largest share of a step's completed groups that may be
dropped). Beyond it the loop keeps uniform groups as they are (they train nothing, and
harm nothing) until the next Consume, and counts them (``flat_kept``). Without it a
run whose groups are nearly all uniform (an untrained policy, a dataset far too hard or
too easy) would generate forever without filling a batch; verl stops such a run after
``max_num_gen_batches``, StaleFlow trains on and says so in the step record.

Pure Python: the loop, the simulator and the restore path share it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from staleness.types import GroupId, TrajId
from trajectory_server.types import LiveTrajectory, TrajState

logger = logging.getLogger(__name__)

# (group, the kept trajectories' graded rewards, None where ungraded) -> has a signal
Decide = Callable[[GroupId, Sequence[float | None]], bool]


def has_signal(rewards: Sequence[float | None]) -> bool:
    """Would group-relative advantages over these rewards be non-zero? ``None`` is a
    trajectory whose reward function failed: it is left out, as the trainer leaves it out."""
    graded = [r for r in rewards if r is not None]
    return len(graded) >= 2 and min(graded) != max(graded)


@runtime_checkable
class Scored(Protocol):
    """A completion that carries its reward (``runtime.interface.Rewarded``)."""

    @property
    def reward(self) -> float | None: ...

    @property
    def error(self) -> str: ...


def graded_reward(completion: object) -> float | None:
    """The reward a completion reports; None when its reward function failed, or when it
    carries none (the simulator grades nothing: it decides with its own rule)."""
    if isinstance(completion, Scored) and not completion.error:
        return completion.reward
    return None


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """``batch_size``: groups per step; ``max_drop``: the largest share of a step's
    completed groups that may be dropped, in [0, 1) (``trainer.dynamic_sampling_max_drop``)."""

    batch_size: int
    max_drop: float = 0.75

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_drop < 1.0:
            raise ValueError(f"max_drop={self.max_drop} must be in [0, 1)")

    @property
    def budget(self) -> int:
        """Groups that may be filtered between two Consumes: a share ``s`` of the step's
        completed groups is ``batch_size x s / (1 - s)`` of them (3 batches at 0.75)."""
        return int(self.batch_size * self.max_drop / (1.0 - self.max_drop) + 1e-9)


@dataclass(slots=True)
class SamplingCounts:
    """Groups that reached ``G`` completions: kept or filtered; ``flat_kept`` of the kept
    were uniform but the step's budget was spent."""

    completed: int = 0
    filtered: int = 0
    flat_kept: int = 0


class DynamicSampling:
    """The filter's state in one control loop: the graded rewards of the groups still
    completing, and the counts since the last step record. ``decide`` replaces
    :func:`has_signal` (the simulator draws its drops instead of grading rewards)."""

    def __init__(self, config: SamplingConfig, decide: Decide | None = None) -> None:
        self.config = config
        self._decide = decide
        self._rewards: dict[GroupId, dict[TrajId, float | None]] = {}
        self.window = SamplingCounts()  # since the last take_window()
        self.total = SamplingCounts()  # since this loop started
        self._warned = False  # in this window

    def note(self, group_id: GroupId, traj_id: TrajId, reward: float | None) -> None:
        """A completion reported to the loop (None: ungraded)."""
        self._rewards.setdefault(group_id, {})[traj_id] = reward

    def seed(self, ledger: Iterable[LiveTrajectory]) -> int:
        """The completions the trajectory server holds (a resumed run: the groups the
        restored manager has partly completed); returns how many."""
        done = [t for t in ledger if t.state is TrajState.COMPLETED]
        for t in done:
            self.note(t.group_id, t.traj_id, t.reward)
        return len(done)

    def forget(self, group_ids: Iterable[GroupId]) -> None:
        """Groups that left (aborted, consumed) or settled without this filter."""
        for gid in group_ids:
            self._rewards.pop(gid, None)

    def keeps(self, group_id: GroupId, kept: Sequence[TrajId], filtered_this_step: int) -> bool:
        """Decide on a group about to be occupied with its ``kept`` trajectories
        (``filtered_this_step``: the staleness manager's count since the last Consume)."""
        rewards = self._rewards.pop(group_id, {})
        if self._decide is not None:
            signal = self._decide(group_id, [rewards.get(t) for t in kept])
        elif missing := [t for t in kept if t not in rewards]:
            # never expected (the reports and the TS's ledger give every reward): keep
            # rather than drop a group on rewards nobody saw
            logger.warning(
                "dynamic sampling: no reward known for trajectories %s of group %d: kept",
                missing,
                group_id,
            )
            signal = True
        else:
            signal = has_signal([rewards[t] for t in kept])
        for counts in (self.window, self.total):
            counts.completed += 1
        if signal:
            return True
        if filtered_this_step >= self.config.budget:
            for counts in (self.window, self.total):
                counts.flat_kept += 1
            self._warn_budget()
            return True
        for counts in (self.window, self.total):
            counts.filtered += 1
        return False

    def take_window(self) -> SamplingCounts:
        """The counts since the last call (one training step's), and start anew."""
        window, self.window = self.window, SamplingCounts()
        self._warned = False
        return window

    def _warn_budget(self) -> None:
        if self._warned:
            return  # once per step record
        self._warned = True
        logger.warning(
            "dynamic sampling filtered %d groups since the last step, its budget "
            "(trainer.dynamic_sampling_max_drop=%g of a step's groups): groups whose "
            "rewards are all equal are trained on as they are until the next step. Is the "
            "task too hard or too easy for the policy?",
            self.config.budget,
            self.config.max_drop,
        )
