"""The tail race: SpecActor's fastest-of-N (specactor.md §4.2) on the oldest buffer's tail.

Why. When the oldest buffer's last trajectories are still generating, the trainer waits
for them (critical.py says why), and the instances that finished their work sit idle.
How fast a straggler's remaining tokens come out depends on things the cost model does
not see (an instance slower than profiled, a slowdown episode, a batch that will grow),
so instead of guessing where it finishes soonest, a copy of it runs on an idle instance
and whichever finishes first completes it; the other is aborted. The idle instance was
doing nothing, so the copy costs only its tokens, counted as wasted when it loses.

Unbiasedness. Keeping the faster of two runs biases training toward short responses
unless both runs produce the same tokens. A copy therefore starts from the trajectory's
current prefix on an instance with the *same weights version* as its holder, and the
engines sample with a per-trajectory seed, so the continuation is identical and only the
time it takes differs. A copy on another version would be a different sample.

What. After routing, while the oldest ``V_traj`` in flight is the tail of its buffer
(``critical.oldest_tail``: at most as many trajectories as instances), each
running trajectory of that version is a candidate, holders of largest estimated step
latency first (the most to gain). Its destination is an instance with nothing running or
queued, the holder's version, KV to spare for the prefix (``gains.spare``) and not already
hosting a copy, the one of least step latency with the copy; each destination takes one
copy per cycle and a trajectory has at most ``copies`` copies at once. The rule only
decides: no Reserve (the trajectory is reserved already) and ``V_traj`` is unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from coordinator.cost_model import CostModel
from coordinator.critical import oldest_tail
from coordinator.fleet import Fleet
from coordinator.gains import spare
from coordinator.pool import TrajectoryPool
from coordinator.types import InstanceId, TrajectoryView
from staleness.types import TrajId


@dataclass(frozen=True, slots=True)
class Race:
    """Start a copy of ``traj`` (running on ``holder``) on ``dest`` from its current
    prefix of ``traj.length`` tokens."""

    traj: TrajectoryView
    holder: InstanceId
    dest: InstanceId


class TailRace:
    """Chooses the copies to start this cycle (module docstring). Keeps no state: who is
    racing where is the caller's (``racing``, ``hosting``)."""

    def __init__(self, cost: CostModel, *, copies: int = 1, fill_steps: int = 0) -> None:
        if copies < 1:
            raise ValueError(f"copies must be >= 1 (got {copies})")
        if fill_steps < 0:
            raise ValueError(f"fill_steps must be >= 0 (got {fill_steps})")
        self.cost = cost
        self.copies = copies
        self.fill_steps = fill_steps

    def select(
        self,
        fleet: Fleet,
        pool: TrajectoryPool,
        racing: Mapping[TrajId, int] | None = None,
        hosting: Collection[InstanceId] = (),
    ) -> list[Race]:
        """Copies to start, one decision after the other. ``racing``: copies already
        running per trajectory; ``hosting``: instances running a copy, which a snapshot
        need not show (a copy is no trajectory of its destination). Pure."""
        racing = racing or {}
        _, on = oldest_tail(fleet, pool)
        if not on:
            return []
        c = self.cost
        idle = (fleet.n_run == 0) & (fleet.n_wait == 0)
        for pos, inst in enumerate(fleet.ids):
            if inst in hosting:
                idle[pos] = False
        if not idle.any():
            return []
        lat = fleet.latencies(c)
        running = [(pos, t) for pos, t in on if t in fleet.run[pos]]
        out: list[Race] = []
        for pos, t in sorted(running, key=lambda pt: (-lat[pt[0]], pt[1].traj_id)):
            free = self.copies - racing.get(t.traj_id, 0)
            while free > 0:
                ok = idle & (fleet.version == fleet.version[pos])
                ok &= spare(c, fleet.n_run, fleet.kv, t.length, self.fill_steps)
                ok[pos] = False
                if not ok.any():
                    break
                # the copy alone on an idle instance, per token
                after = c.token_latencies(1.0, fleet.kv + c.k5 * t.length) * fleet.speed
                candidates = np.flatnonzero(ok)
                best = int(candidates[after[candidates].argmin()])
                out.append(Race(t, fleet.ids[pos], fleet.ids[best]))
                idle[best] = False
                free -= 1
            if not idle.any():
                break
        return out
