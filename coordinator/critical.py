"""The critical-path rule: the trajectories that keep the oldest staleness buffer from
becoming Ready run where they finish soonest.

Why. The trainer at version ``v`` consumes buffer ``v``, and every group whose version is
``v - eta`` must be in it (Eq. of §4: ``V_traj <= V_buf <= V_traj + eta``). So the oldest
trajectories still generating are the trainer's critical path: until the last of them
completes, the buffer is not Ready, the trainer waits, and because the in-flight window is
bounded, completed groups of later buffers pile up while the staleness manager admits
nothing new. In a long-tailed workload these are a few long trajectories, each sharing an
instance with up to hundreds of others, so every token costs the full batch's step
latency (Eq. 11), on a slow instance more. Neither throughput routing nor Algorithm 5
looks at this: they maximise the fleet's instantaneous throughput.

What. Each cycle the rule looks at the trajectories on instances (running or queued) whose
``V_traj`` is the oldest in flight (on an instance or waiting in the TS). Once they are few
enough to be the tail of their buffers (at most ``tail`` per instance), each one whose
instance's estimated step latency is at least ``speedup`` times the latency it would have
on the best other instance (including the trajectory itself, with the instance's
estimated speed), or that is queued where it is, is interrupted and routed, in the same
cycle, to the instance of least step latency with it, instead of being left to the
throughput routing. A destination must have KV to spare with it (the fill rule's test,
``gains.spare``: a move that gets the trajectory preempted helps nothing) and have no
queue. A trajectory moved once is not moved again until it has generated tokens since,
the rule Algorithm 5 already follows.

The coordinator never knows how many tokens a trajectory still has to go; the rule uses
only the fact that the oldest trajectories are the ones the trainer waits for.

Why ``tail`` trajectories per instance, and not one (the first version of this rule). In
the warm-up every buffer up to ``eta`` holds version-0 groups, and the longest of them
(cap-length on a heavy tail) decide when buffer ``eta`` is Ready. With one per instance
the rule woke when the trainer already waited: on `heavy-tail` (η = 3, 64 instances) the
last version-0 trajectories then ran in batches of 60-100 that the PS's newer groups had
refilled, and step 4 waited 307 s. Eight per instance moves them while they can still
catch up (docs/simulator.md, "The critical tail"). ``oldest_tail`` is shared with the
synchronisation, which does not Pull an instance running one (sync.py), and with the
tail race (race.py, one per instance).
"""

from __future__ import annotations

import numpy as np

from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.pool import Level, TrajectoryPool
from coordinator.types import TrajectoryView
from staleness.types import TrajId

Move = tuple[int, TrajectoryView, int]  # (from position, trajectory, to position)


class CriticalPath:
    """Chooses critical trajectories to move and where (module docstring)."""

    def __init__(
        self,
        cost: CostModel,
        *,
        speedup: float = 1.5,
        fill_steps: int = 0,
        tail: int = 1,
        moved_at: dict[TrajId, int] | None = None,
        waiting: bool = False,
    ) -> None:
        if not speedup > 1.0:
            raise ValueError(f"speedup must be > 1 (got {speedup})")
        if fill_steps < 0:
            raise ValueError(f"fill_steps must be >= 0 (got {fill_steps})")
        if tail < 1:
            raise ValueError(f"tail must be >= 1 trajectory per instance (got {tail})")
        self.cost = cost
        self.speedup = speedup
        self.fill_steps = fill_steps  # headroom a destination keeps (gains.spare)
        self.tail = tail
        self.waiting = waiting  # count trajectories waiting on tools (oldest_tail)
        # traj_id -> its length when last moved; shared with the migration strategy
        # (build_strategies): a trajectory either moved is left alone until it decodes
        self._moved_at: dict[TrajId, int] = {} if moved_at is None else moved_at

    def select(
        self, fleet: Fleet, pool: TrajectoryPool, ps_version: int | None = None
    ) -> list[Move]:
        """Moves for this cycle, decided one after the other (a destination chosen for one
        trajectory is loaded with it for the next). Does not modify ``fleet``.

        With ``ps_version``, instances behind the PS are preferred as destinations when
        one qualifies: nothing new is admissible at their version, so they drain, and a
        trajectory moved there stays in a light batch; an up-to-date instance is refilled
        by routing in the same cycle."""
        oldest, on = oldest_tail(fleet, pool, self.tail, self.waiting)
        if not on:
            return []
        c = self.cost
        lat = fleet.latencies(c)
        queued = {t.traj_id for pos, t in on if t in fleet.wait[pos]}
        n, kv = fleet.n_run.copy(), fleet.kv.copy()
        open_ = (fleet.n_wait == 0) & (fleet.version >= oldest)
        if not open_.any():
            return []
        draining = fleet.version < ps_version if ps_version is not None else None
        # With a trajectory of length L, a destination's step latency is a + b * L and it
        # has room when ``room >= k5 * L`` (the fill rule's test, gains.spare); a move
        # updates its own entries only. Both a and b only grow as moves load a destination,
        # so min(a) + min(b) * L bounds every later choice from below: a running trajectory
        # whose instance is not ``speedup`` times slower than that can never move, and is
        # skipped without touching the arrays. With ``tail`` per instance the tail holds
        # thousands at 1,024 instances, and this loop runs every cycle.
        speed = fleet.speed
        # (Per token with speculation: a larger batch verifies fewer drafts and keeps fewer
        # tokens per trajectory. At the measured acceptance (0.77 to 0.82) a and b still
        # only grow with the load; below about 0.5, where a smaller draft can make the
        # step cheaper per token, the bound may skip a move, never make a wrong one.)
        a = c.token_latencies(n + 1.0, kv) * speed
        b = c.kv_slopes(n + 1.0) * c.k5 * speed
        room = c.kv_budget - kv - c.k5 * (n + 1.0) * self.fill_steps
        a_min, b_min = float(a[open_].min()), float(b[open_].min())
        out: list[Move] = []
        # Longest first: the longest have generated most and, in a heavy tail, have the
        # most still to generate.
        # (Two stable sorts on scalar keys: a tuple key per trajectory allocates enough
        # to set off the garbage collector's full pass at 1,024 instances.)
        on.sort(key=_traj_id)
        on.sort(key=_length, reverse=True)
        for pos, t in on:
            stays = t.traj_id not in queued  # a queued one makes no progress where it is
            if stays and lat[pos] < self.speedup * (a_min + b_min * t.length):
                continue
            if self._moved_at.get(t.traj_id, -1) >= t.length:
                continue
            was_open, open_[pos] = open_[pos], False
            ok = open_ & (room >= c.k5 * t.length)
            open_[pos] = was_open
            if draining is not None:
                preferred = ok & draining
                if preferred.any():
                    ok = preferred
            after = np.where(ok, a + b * t.length, np.inf)
            best = int(after.argmin())
            if not ok[best]:
                continue  # no room for this one: a shorter one may still fit
            if stays and lat[pos] < self.speedup * after[best]:
                continue
            out.append((pos, t, best))
            self._moved_at[t.traj_id] = t.length
            n[best] += 1.0
            kv[best] += c.k5 * t.length
            a[best] = c.token_latency(n[best] + 1.0, kv[best]) * speed[best]
            b[best] = c.kv_slope(n[best] + 1.0) * c.k5 * speed[best]
            room[best] = c.kv_budget - kv[best] - c.k5 * (n[best] + 1.0) * self.fill_steps
        if len(self._moved_at) > 1 << 16:  # forget trajectories long gone
            self._moved_at.clear()
        return out


def oldest_in_flight(
    fleet: Fleet, levels: list[Level], away: list[int] | None = None
) -> int | None:
    """The lowest ``V_traj`` of the partial trajectories of ``levels``, of those on the
    instances and of ``away`` (versions of trajectories at their tools); None if none."""
    lows = [v for v, _ in levels if v is not None]
    lows += [min(vs) for vs in fleet.versions() if vs]
    if away:
        lows.append(min(away))
    return min(lows) if lows else None


def oldest_tail(
    fleet: Fleet, pool: TrajectoryPool, per_instance: int = 1, waiting: bool = False
) -> tuple[int, list[tuple[int, TrajectoryView]]]:
    """The lowest ``V_traj`` in flight (on an instance or partial in the TS) and the
    trajectories of that version on instances, with their positions, when they are the
    tail of their version (at most ``per_instance`` per instance, counting those in the
    TS); none otherwise. ``map`` over an attribute getter keeps the per-trajectory work in
    C: this runs every cycle over every trajectory in flight.

    ``waiting`` (multi-turn work): trajectories waiting on their environment are in
    flight too, and count for the oldest version and its tail (they cannot be moved, so
    they are not in the list). Without it the rule sees a version whose trajectories are
    all at their tools as finished, and takes the next one for the trainer's critical
    path, or the tail as reached while most of it waits on tools."""
    away = fleet.env_versions() if waiting and fleet.n_env.any() else []
    oldest = oldest_in_flight(fleet, pool.levels(), away)
    if oldest is None:
        return 0, []
    versions = fleet.versions()
    counts = [vs.count(oldest) for vs in versions]
    count = sum(counts) + sum(len(ts) for v, ts in pool.levels() if v == oldest)
    count += away.count(oldest)
    if count > per_instance * len(fleet):
        return oldest, []  # not the tail yet: moving thousands would cost more than it saves
    on = []
    for pos, k in enumerate(counts):
        if k:  # find its k with list.index (in C), not a Python pass over the batch
            vs, trajs, i = versions[pos], fleet.trajectories(pos), -1
            for _ in range(k):
                i = vs.index(oldest, i + 1)
                on.append((pos, trajs[i]))
    return oldest, on


def _traj_id(pt: tuple[int, TrajectoryView]) -> int:
    return pt[1].traj_id


def _length(pt: tuple[int, TrajectoryView]) -> int:
    return pt[1].length
