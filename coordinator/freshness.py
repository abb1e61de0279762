"""eta as a ceiling, not a target: admit a group just early enough to be complete when the
trainer wants its buffer.

Today's admission (Algorithm 3 with the staleness manager's Reserve) starts a group as soon
as the window ``[V, V + eta]`` has room. When the trainer binds, the rollout therefore runs
the whole window ahead and nearly every sample is as stale as the bound allows, although
the instances idle most of the time. Generating the same groups later costs no throughput
and gives fresher data.

The rule. Groups fill buffers from the trainer's on (``version``), ``capacity`` entries
each, so with ``tracked`` groups already in the window the next new group goes to buffer
``version + tracked // capacity``. The trainer wants buffer ``version`` at ``want`` (now
if it is already waiting for it; else when its running step is expected to end, from its
measured step time ``T``) and buffer ``version + j`` at ``want + j * T``. A new group is
admitted this cycle only if its buffer is wanted within ``need`` seconds, where

    need = max(0, C + margin)

``C`` is the group's estimated completion time: the longest response of a recent group
(tokens) times the fleet's decode step latency with one more trajectory per instance
(the cost model at the instances' current loads, times each instance's measured speed
factor, coordinator/estimation.py), averaged over the instances. ``margin`` is the
``quantile`` over recent buffers of how late completions ran against that estimate
(seconds, from a first Reserve to an Occupy, rewards included), so whatever the estimate
misses (queueing, prefill, a cost model profiled on other hardware, reward latency) is
learned online; a history of late completions raises it. Completions are counted in
admission order, the n-th against the n-th admission: occupied groups move to the
earliest buffer with room, so a buffer fills once as many groups completed as were
admitted for it and those before, whichever they are, and a straggler's place is taken
by a later group that finished first. Timing each group on its own would make the margin
the tail of one group's time, and hold nothing wherever group lengths are heavy-tailed.

When it gives way. The rule only removes new groups from one cycle's routable set: it
never admits anything the manager would not (eta stays a hard ceiling), never touches a
group already started (its other members, redundancy), and never delays a group for a
buffer the trainer is waiting for (``want = now`` then, so ``need >= 0`` admits it). It
delays nothing until it has measured a training step and ``min_samples`` groups, at
``eta = 0`` (every sample is on-policy already), and while the trainer's mean wait for
its buffer over its last steps exceeds ``give_way`` of its step time: the trainer is
waiting, because the rollout binds or because the rule started groups too late; either
way admission is as early as eta allows until the trainer has been fed on time again.

Pure: fed by the control loop (the trainer asked for a buffer, was served one; a member
finished, a group completed) and by the coordinator's cycle; no clock of its own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from coordinator.commands import Command, Route
from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.types import TrajectoryView
from staleness.interface import AdmissionSketch
from staleness.types import GroupId

# Remembered per group between its admission and its completion; groups that never complete
# (aborted) are forgotten oldest first beyond this many.
_MAX_OPEN = 1 << 14


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the smallest value with at least ``q`` of them at
    or below it); 0.0 for none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class TrainerPace:
    """When the trainer wants its buffers: from when it asked for each and got it.

    A step is the time from being served a buffer to asking for the next (training, the
    Push, evaluation: whatever the trainer does between two buffers); its estimate is the
    shortest of the last ``window`` steps. A wait is the time from asking to being served."""

    def __init__(self, window: int = 8) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        self._steps: deque[float] = deque(maxlen=window)
        self._waits: deque[float] = deque(maxlen=window)
        # Waits count only once set (the rule first decided): the warm-up's buffers are
        # slow to fill whoever admits them, and would make the rule give way for nothing.
        self.count_waits = False
        self._asked: float | None = None
        self._served: float | None = None

    def asked(self, now: float) -> None:
        """The trainer asked for its next buffer (repeated asks keep the first)."""
        if self._asked is not None:
            return
        self._asked = now
        if self._served is not None:
            self._steps.append(max(0.0, now - self._served))

    def served(self, now: float) -> None:
        """The trainer got its buffer (Consume)."""
        asked = self._asked if self._asked is not None else now
        if self.count_waits:
            self._waits.append(max(0.0, now - asked))
        self._asked, self._served = None, now

    @property
    def waiting(self) -> bool:
        return self._asked is not None

    @property
    def step_s(self) -> float | None:
        """The trainer's step time, None before one ended: the shortest of the recent
        ones, since a step shorter than expected wants its buffer early (a step's time
        follows its batch's tokens), and a longer one only leaves its buffer waiting."""
        return min(self._steps) if self._steps else None

    def wants_at(self, now: float) -> float | None:
        """When the trainer wants the buffer it consumes next (now if it waits for it)."""
        if self._asked is not None:
            return now
        step = self.step_s
        if step is None or self._served is None:
            return None
        return max(now, self._served + step)

    def wait_share(self) -> float:
        """The trainer's mean wait over its recent buffers, as a share of its step time."""
        step = self.step_s
        if not self._waits or not step:
            return 0.0
        return sum(self._waits) / len(self._waits) / step


@dataclass(frozen=True, slots=True)
class FreshnessState:
    """The rule at its last cycle, for the step record and the dashboard."""

    active: bool = False  # it decided the last cycle (pace, estimates and samples known)
    giving_way: bool = False  # the trainer waits: admission as early as eta allows
    need_s: float = 0.0  # C + margin at the last cycle
    estimate_s: float = 0.0  # C
    margin_s: float = 0.0
    step_s: float = 0.0  # the trainer's measured step time
    held_groups: int = 0  # new groups held back at the last cycle
    held_cycles: int = 0  # cycles so far that held a group back


class FreshnessRule:
    """See the module docstring."""

    def __init__(
        self,
        cost: CostModel,
        *,
        quantile: float = 0.9,
        give_way: float = 0.02,
        history: int = 32,
        min_samples: int = 2,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1) (got {quantile})")
        if not give_way >= 0.0:
            raise ValueError(f"give_way must be >= 0 (got {give_way})")
        if history < 1 or min_samples < 1:
            raise ValueError(f"history and min_samples must be >= 1 ({history}, {min_samples})")
        self.cost = cost
        self.q = quantile
        self.give_way = give_way
        self.min_samples = min_samples
        self.pace = TrainerPace()
        # per consumed buffer: how late it filled against its groups' estimates, seconds
        self._lateness: deque[float] = deque(maxlen=history)
        self._longest: deque[int] = deque(maxlen=history)  # longest response per group
        # admitted groups not completed nor dropped -> (first Reserve, estimate then)
        self._open: dict[GroupId, tuple[float, float | None]] = {}
        # the admissions no completion has been counted against yet, oldest first
        self._unmatched: deque[tuple[float, float | None]] = deque(maxlen=_MAX_OPEN)
        self._late_since: float | None = None  # the latest lateness since the last Consume
        self._longest_of: dict[GroupId, int] = {}  # finished members' longest so far
        self._estimate: float | None = None  # C at the last cycle
        self.state = FreshnessState()

    # -- what the control loop tells it ---------------------------------------------------

    def finished(self, group_id: GroupId, response_len: int) -> None:
        """A member of ``group_id`` finished with ``response_len`` tokens."""
        if response_len > self._longest_of.get(group_id, -1):
            self._longest_of[group_id] = response_len
            if len(self._longest_of) > _MAX_OPEN:
                del self._longest_of[next(iter(self._longest_of))]

    def completed(self, group_id: GroupId, now: float) -> None:
        """``group_id`` became complete (Occupied) at ``now``: learn its length, and how
        late the completions run against the admissions (see :meth:`consumed`)."""
        longest = self._longest_of.pop(group_id, None)
        if longest is not None:
            self._longest.append(longest)
        # a group admitted before the rule saw it (restored at a resume) is not counted
        if self._open.pop(group_id, None) is not None and self._unmatched:
            t0, estimate = self._unmatched.popleft()
            if estimate is not None:
                late = (now - t0) - estimate
                if self._late_since is None or late > self._late_since:
                    self._late_since = late

    def dropped(self, group_ids: Iterable[GroupId]) -> None:
        """These groups were dropped (aborted, a redundant surplus): they will never
        complete, so their admissions leave the count."""
        for g in group_ids:
            started = self._open.pop(g, None)
            if started is None:
                continue
            try:  # groups admitted in one cycle are interchangeable here
                self._unmatched.remove(started)
            except ValueError:  # already counted against an earlier completion
                if self._unmatched:
                    self._unmatched.popleft()

    def consumed(self, now: float) -> None:
        """The trainer was served a buffer at ``now``: the margin's sample is the latest
        of the completions since the last buffer, each against the admission its count
        matches (module docstring)."""
        self.pace.served(now)
        self.learn()

    def learn(self) -> None:
        """Close the margin's sample of one buffer (see :meth:`consumed`)."""
        if self._late_since is not None:
            self._lateness.append(self._late_since)
            self._late_since = None

    @property
    def margin_s(self) -> float:
        return quantile(self._lateness, self.q)

    # -- what the coordinator's cycle asks ------------------------------------------------

    def estimate(self, fleet: Fleet, factors: npt.NDArray[np.float64] | None) -> float | None:
        """``C``: seconds for a group started now to complete (None: nothing learned yet)."""
        if not self._longest or not len(fleet):
            return None
        c = self.cost
        latency = c.token_latencies(fleet.n_run + 1.0, fleet.kv)
        if factors is not None:
            latency = latency * factors
        return float(np.mean(latency)) * (sum(self._longest) / len(self._longest))

    def hold(
        self,
        ts_trajs: Sequence[TrajectoryView],
        sketch: AdmissionSketch,
        fleet: Fleet,
        now: float,
        factors: npt.NDArray[np.float64] | None = None,
    ) -> set[GroupId]:
        """The new groups (no member admitted yet) to keep out of this cycle's routing."""
        self._estimate = estimate = self.estimate(fleet, factors)
        want, step = self.pace.wants_at(now), self.pace.step_s
        giving_way = self.pace.wait_share() > self.give_way
        margin = self.margin_s
        active = (
            sketch.eta > 0
            and want is not None
            and step is not None
            and step > 0.0
            and estimate is not None
            and len(self._lateness) >= self.min_samples
        )
        need = max(0.0, (estimate or 0.0) + margin)
        held: set[GroupId] = set()
        self.pace.count_waits |= active
        if active and not giving_way:
            assert want is not None and step is not None
            lead = want - now  # until the trainer wants buffer ``version``
            window = sketch.eta + 1
            if lead > need:
                buffers = 0
            elif need - lead >= window * step:
                buffers = window  # the whole window is due (and a tiny step cannot overflow)
            else:
                buffers = math.floor((need - lead) / step) + 1
            room = buffers * sketch.capacity - sketch.tracked  # new groups admitted now
            seen: set[GroupId] = set()
            for t in ts_trajs:
                g = t.group_id
                if t.v_traj is not None or g in seen or sketch.tracks(g):
                    continue
                seen.add(g)
                if len(seen) > room:
                    held.add(g)
        self.state = FreshnessState(
            active=active,
            giving_way=active and giving_way,
            need_s=need,
            estimate_s=estimate or 0.0,
            margin_s=margin,
            step_s=step or 0.0,
            held_groups=len(held),
            held_cycles=self.state.held_cycles + (1 if held else 0),
        )
        return held

    def note(self, commands: Iterable[Command], now: float) -> None:
        """The commands of this cycle: the groups whose first member was just Reserved
        start their clock (their estimate is this cycle's ``C``)."""
        estimate, opened = self._estimate, self._open
        for c in commands:
            if isinstance(c, Route):
                for r in c.reservations:
                    if r.group_id not in opened:
                        opened[r.group_id] = (now, estimate)
                        self._unmatched.append((now, estimate))
        while len(opened) > _MAX_OPEN:
            del opened[next(iter(opened))]
