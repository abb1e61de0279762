"""A simulated rollout instance: continuous batching under the cost model of Appendix B.

One decode step of ``n`` running trajectories holding ``kv`` KV tokens takes
``k1*kv + max(k2, k3*n) + k4`` seconds and gives every running trajectory one token, so
``kv`` grows by ``k5*n`` per step. Time advances in *chunks* of whole steps during which
``n`` is fixed: until the next completion, until the KV budget ``M`` would overflow, or
until the caller's horizon. The duration of a chunk of ``s`` steps is an arithmetic series
(kv grows linearly), so no per-token work is done. Trajectory lengths are derived from a
per-instance step counter, never updated one by one.

When the cache is full, the most recently admitted trajectories are preempted into the
front of the waiting queue and release their KV (recompute preemption, as vLLM and SGLang
do); re-admission costs a re-prefill of the whole prefix, like a Route after an Interrupt.

The step latency above is what the coordinator *estimates*. What the instance really does
comes from its :class:`~staleflow.sim.truth.InstanceTruth` (a per-instance speed, an
estimate error, slowdown episodes, a measured profile or step trace); without one it
follows the estimate. Either way the instance records how far the estimate was from what
it did, period by period (``InstanceTimes.estimate_error``), the figure Appendix B.2 reports.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.cost_model import CostModel
from coordinator.types import InstanceSnapshot
from staleflow.sim.speculation import SpeculationProfile, speculative
from staleflow.sim.truth import EngineTruth, InstanceTruth, ScaledCost
from trajectory_server.types import PartialTrajectory, RoutedTrajectory


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """Costs beyond the decode step (seconds).

    prefill_s_per_token, prefill_s_per_token_sq: (re-)prefill of a routed or re-admitted
    prefix of ``L`` tokens takes ``a*L + b*L**2`` seconds: the linear layers cost the same
    per token, causal attention over the prefix grows with its square (FlashAttention is
    compute-bound in prefill). ``b = 0`` is a flat per-token cost.
    pull_s: one Pull (bytes / bandwidth + latency), blocking the instance.
    noise: sigma of a lognormal multiplicative factor drawn per chunk (0: exact model).
    truth: how the engines' decode steps differ from the coordinator's cost model
    (``staleflow.sim.truth``); the default is no difference.
    kv_pool: the KV cache of a trajectory whose chunk ended (divided rollout) stays in a
    pool every instance reads, as Seer's Mooncake-based global KV cache (seer.md §4.2):
    re-placing it costs no prefill. Off: it is prefilled again, as on the engines here.
    keep_kv: a trajectory that leaves the batch without finishing (its model turn ended
    at a tool call, or an Interrupt took it) leaves its KV in the instance's prefix cache
    (SGLang's radix cache, vLLM's prefix caching): routed back here before it is evicted,
    only its new tokens (the observation) are prefilled. The cache takes only what
    decoding does not need, least recently used out first, and a Pull empties it. Off:
    the KV is freed, and every route prefills the whole prefix.
    speculation: the engines verify drafts (``rollout.speculation``): each decode step
    follows ``sim/speculation.py``'s model on top of the truth. None: off.
    tell_coordinator: the coordinator's cost model knows ``speculation`` (as a real launch
    tells it, ``CostModel.speculation``). Off: it plans with the plain model, to measure
    what not being told costs.
    """

    prefill_s_per_token: float = 6.0e-5
    pull_s: float = 3.0
    noise: float = 0.0
    prefill_s_per_token_sq: float = 0.0
    truth: EngineTruth = field(default_factory=EngineTruth)
    kv_pool: bool = False
    keep_kv: bool = False
    speculation: SpeculationProfile | None = None
    tell_coordinator: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "prefill_s_per_token_sq", "pull_s", "noise"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"EngineCosts.{name} must be >= 0 (got {getattr(self, name)})")

    def prefill_seconds(self, length: int, cached: int = 0) -> float:
        """Time to (re-)prefill a prefix of ``length`` tokens whose first ``cached`` are in
        the KV cache already (only the rest is computed, attending to all before it)."""
        new = length - cached
        return self.prefill_s_per_token * new + self.prefill_s_per_token_sq * (
            length * length - cached * cached
        )


class SimTrajectory:
    """One trajectory on an instance. Satisfies ``coordinator.TrajectoryView``: ``length``
    is read from the instance's step counter, so snapshots need no copies."""

    __slots__ = (
        "base",
        "end",
        "group_id",
        "inst",
        "payload",
        "prompt_len",
        "start",
        "target",
        "traj_id",
        "turn_end",
        "v_traj",
    )

    def __init__(
        self,
        payload: RoutedTrajectory,
        target: int,
        inst: SimInstance,
        end: int | None = None,
        turn_end: bool = False,
    ) -> None:
        self.payload = payload
        self.traj_id = payload.traj_id
        self.group_id = payload.group_id
        self.v_traj: int = payload.v_traj
        self.prompt_len = len(payload.prompt)
        self.base = payload.length  # prompt + tokens when this run segment began
        self.target = target  # prompt + full response
        # Where this route stops: the target, or the end of its chunk (divided rollout,
        # coordinator/seer.py), after which the trajectory goes back to the TS.
        self.end = target if end is None else min(end, target)
        # ``end`` is where a model turn ends at a tool call (multi-turn work): the
        # trajectory then goes to its environment, not back to the TS (staleflow.sim.env)
        self.turn_end = turn_end and self.end < target
        self.inst = inst
        self.start = -1  # instance step at which it started running; -1 while waiting

    @property
    def length(self) -> int:
        if self.start < 0:
            return self.base
        return self.base + self.inst.steps - self.start

    @property
    def response_len(self) -> int:
        return self.length - self.prompt_len

    def response(self, version: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whole response so far: the routed prefix plus what this instance generated."""
        # Token ids and logprobs are constants; read-only broadcast views cost no memory
        # and the TS keeps read-only arrays as they are. Versions stay real per token.
        n = self.length - self.prompt_len
        tokens = constant(np.int32, 1, n)
        logprobs = constant(np.float32, 0.0, n)
        prefix = self.payload.versions
        if len(prefix) == 0 or is_constant(prefix, np.int32, version):
            return tokens, logprobs, constant(np.int32, version, n)
        new = np.full(n - len(prefix), version, np.int32)
        versions = np.concatenate([prefix, new])
        versions.flags.writeable = False
        return tokens, logprobs, versions

    def mask(self) -> np.ndarray | None:
        """The loss mask of :meth:`response`: the routed prefix's (observations False),
        then True for what this instance generated; None when all True."""
        prefix = self.payload.mask
        if prefix is None or len(prefix) == 0 or prefix.all():
            return None
        out = np.ones(self.length - self.prompt_len, dtype=np.bool_)
        out[: len(prefix)] = prefix
        return out


@dataclass(slots=True)
class InstanceTimes:
    """Where an instance's virtual time went (seconds)."""

    decode: float = 0.0
    prefill: float = 0.0
    pull: float = 0.0
    idle: float = 0.0
    tokens: int = 0
    preemptions: int = 0
    chunks: int = 0  # trajectories returned to the TS at a chunk boundary (divided rollout)
    reprefill_tokens: int = 0  # prefix tokens prefilled again (resumed partials, preemptions)
    prefix_hits: int = 0  # prefix tokens a route found in this instance's cache (keep_kv)
    turns: int = 0  # model turns that ended here at a tool call (multi-turn work)
    wasted_tokens: int = 0  # response tokens of trajectories aborted here
    # Appendix B.2's figure: mean over periods with decoding of |estimated - actual| /
    # actual throughput, the estimate being the coordinator's model on the same steps.
    error_sum: float = 0.0
    error_periods: int = 0

    @property
    def estimate_error(self) -> float:
        return self.error_sum / self.error_periods if self.error_periods else 0.0


Finished = Callable[[float, "SimInstance", SimTrajectory], None]


class SimInstance:
    """A rollout engine with a virtual clock (``clock`` may run past the caller's horizon
    by at most one decode step: commands then take effect after that step)."""

    def __init__(
        self,
        inst_id: int,
        cost: CostModel,
        costs: EngineCosts,
        rng: np.random.Generator,
        truth: InstanceTruth | None = None,
        pool: set[int] | None = None,
    ) -> None:
        self.inst_id = inst_id
        # ids whose KV cache a chunk end left in the shared pool (EngineCosts.kv_pool)
        self.pool = pool
        self.cost, self.costs, self.rng = cost, costs, rng
        self.truth = speculative(truth or InstanceTruth(ScaledCost(cost)), costs.speculation)
        self.version = 0
        self.clock = 0.0
        self.steps = 0
        self.running: dict[int, SimTrajectory] = {}  # admission order
        self.waiting: list[SimTrajectory] = []  # head first
        # since the last Pull: finished here, or returned to the TS at a chunk boundary
        self.completed: list[int] = []
        self.returned: list[PartialTrajectory] = []  # chunk ends not yet handed to the TS
        # ids running or waiting here as race copies (staleflow/sim/race.py): in the batch
        # and the KV, but no trajectory of this instance, so snapshots leave them out
        self.copies: set[int] = set()
        self._sum_base = 0  # sum over running of (base - start): kv = k5*(sum + n*steps)
        self._finish: list[tuple[int, int]] = []  # (step it completes at, traj_id)
        self._debt = 0.0  # prefill time owed before the next decode step
        self.times = InstanceTimes()
        # the prefix cache (EngineCosts.keep_kv): trajectory -> KV tokens, least recently
        # used first; only what decoding leaves free (_trim)
        self.held: dict[int, int] = {}
        self._held_total = 0
        # trajectories whose last turn ended here and that wait on their environment;
        # kept by the cluster's environments (sim/env.py), reported in snapshots
        self.env: dict[int, SimTrajectory] = {}
        # called when a model turn ends at a tool call (multi-turn work); None: no such
        # turns (every route ends at its target or a chunk boundary)
        self.turned: Finished | None = None

    # -- state ------------------------------------------------------------------------

    @property
    def kv(self) -> float:
        return self.cost.k5 * (self._sum_base + len(self.running) * self.steps)

    def snapshot(self) -> InstanceSnapshot:
        run, wait = tuple(self.running.values()), tuple(self.waiting)
        if self.copies:
            run = tuple(t for t in run if t.traj_id not in self.copies)
            wait = tuple(t for t in wait if t.traj_id not in self.copies)
        return InstanceSnapshot(
            inst=self.inst_id,
            kv_cache=int(self.kv),
            run_trajs=run,
            wait_trajs=wait,
            complete_trajs=tuple(self.completed),
            inst_version=self.version,
            env_trajs=tuple(self.env.values()),
            held=tuple(self.held.items()),
            held_exact=True,
        )

    def take_returned(self) -> list[PartialTrajectory]:
        """Partials of the chunks that ended since the last call (for the TS)."""
        out, self.returned = self.returned, []
        return out

    def holds(self) -> list[int]:
        """Ids of the trajectories running or waiting here (race copies are not theirs)."""
        out = [*self.running, *(t.traj_id for t in self.waiting)]
        return [t for t in out if t not in self.copies] if self.copies else out

    # -- commands ---------------------------------------------------------------------

    def submit(self, trajs: Sequence[SimTrajectory], now: float) -> None:
        """Queue routed trajectories; they run as soon as the cache admits them."""
        self.clock = max(self.clock, now)
        self.waiting.extend(trajs)
        self._admit()

    def start_copy(self, copy: SimTrajectory, now: float) -> None:
        """Queue a race copy (it pays the prefill of its whole prefix when admitted)."""
        self.copies.add(copy.traj_id)
        self.submit([copy], now)

    def settle(self, tid: int, now: float, completed: bool) -> int:
        """End a raced trajectory here because the other side finished first: recorded
        as completed here (the holder) or gone (a copy). Returns its length."""
        self.clock = max(self.clock, now)
        t = self.running.get(tid)
        if t is not None:
            self._stop(t)
        else:
            t = next(w for w in self.waiting if w.traj_id == tid)
            self.waiting.remove(t)
        self.copies.discard(tid)
        if completed:
            self.completed.append(tid)
        self._admit()
        return t.length

    def remove(self, ids: Sequence[int], now: float) -> dict[int, PartialTrajectory]:
        """Interrupt or abort: take trajectories off the instance, with their partials."""
        self.clock = max(self.clock, now)
        out: dict[int, PartialTrajectory] = {}
        wanted = set(ids)
        for tid in ids:
            t = self.running.get(tid)
            if t is not None:
                out[tid] = self._partial(t)
                self._stop(t)
                self._hold(t)
        if any(t.traj_id in wanted for t in self.waiting):
            kept = []
            for t in self.waiting:
                if t.traj_id in wanted:
                    out[t.traj_id] = self._partial(t)
                else:
                    kept.append(t)
            self.waiting = kept
        if out:
            self._admit()
        return out

    def abort(self, ids: Sequence[int], now: float) -> list[int]:
        """Drop trajectories for good; their response tokens were generated for nothing."""
        removed = self.remove(ids, now)
        self.times.wasted_tokens += sum(len(p.tokens) for p in removed.values())
        for tid in ids:
            self._release(tid)
        return list(removed)

    def pull(self, version: int, now: float) -> None:
        if self.running or self.waiting:
            raise RuntimeError(
                f"instance {self.inst_id}: Pull with trajectories still on it; the executor "
                "must Interrupt them first"
            )
        start = max(self.clock, now)
        self.clock = start + self.costs.pull_s
        self.times.pull += self.costs.pull_s
        self.version = version
        self.completed = []
        self.held.clear()  # KV computed by the old weights
        self._held_total = 0

    # -- time -------------------------------------------------------------------------

    def advance(self, horizon: float, finished: Finished) -> None:
        """Run whole decode steps until ``horizon`` (the last one may end past it)."""
        c, times = self.cost, self.times
        step, slow = self.truth.step, self.truth.slowdowns
        actual = estimated = 0.0  # decode seconds this call, and the estimate's for them
        while self.clock < horizon:
            if self._held_total:
                self._trim()
            if self._debt > 0.0:
                self.clock += self._debt
                times.prefill += self._debt
                self._debt = 0.0
                continue
            n = len(self.running)
            if n == 0:
                times.idle += horizon - self.clock
                self.clock = horizon
                break
            kv = self.kv
            if kv + c.k5 * n > c.kv_budget and n > 1:
                self._preempt()
                continue
            to_full = max(1, int((c.kv_budget - kv) // (c.k5 * n)))
            to_done = self._finish[0][0] - self.steps
            first = step.latency(n, kv)  # latency of the first step
            growth = step.kv_slope(n) * c.k5 * n  # added to the latency by each further step
            f = math.exp(self.costs.noise * self.rng.standard_normal()) if self.costs.noise else 1.0
            if slow is not None:
                f *= slow.factor(self.clock)
            k = min(to_full, to_done, _steps_within((horizon - self.clock) / f, first, growth))
            duration = f * (k * first + growth * k * (k - 1) / 2.0)
            # the coordinator's model of the same steps (per token, as ``step`` is)
            est_first = c.token_latency(n, kv)
            estimated += k * est_first + c.kv_slope(n) * c.k5 * n * k * (k - 1) / 2.0
            actual += duration
            self.clock += duration
            times.decode += duration
            times.tokens += n * k
            self.steps += k
            self._complete_due(finished)
        if estimated > 0.0:
            times.error_sum += abs(actual - estimated) / estimated
            times.error_periods += 1

    def _complete_due(self, finished: Finished) -> None:
        while self._finish and self._finish[0][0] <= self.steps:
            _, tid = heapq.heappop(self._finish)
            t = self.running.get(tid)
            if t is None or t.start + t.end - t.base != self.steps:
                continue  # stale heap entry (preempted or removed)
            self._stop(t)
            if tid in self.copies:  # a race copy: its holder counts the completion
                self.copies.discard(tid)
            else:
                self.completed.append(tid)
            if t.turn_end:  # a tool call: to its environment (sim/env.py), KV cached
                assert self.turned is not None, "a turn ended with no environment to take it"
                self.times.turns += 1
                self._hold(t)
                self.turned(self.clock, self, t)
            elif t.end < t.target:  # a chunk boundary: back to the TS, to be re-placed
                self.times.chunks += 1
                self.returned.append(self._partial(t))
                if self.pool is not None:
                    self.pool.add(tid)
            else:
                finished(self.clock, self, t)
        self._admit()

    # -- internals --------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit the head of the queue while it fits with one step of headroom."""
        c = self.cost
        while self.waiting:
            t = self.waiting[0]
            n1 = len(self.running) + 1
            if self.running and self.kv + c.k5 * (t.length + n1) > c.kv_budget:
                return
            self.waiting.pop(0)
            if self.pool is not None and t.traj_id in self.pool:
                self.pool.discard(t.traj_id)  # its KV cache comes from the pool
            else:
                cached = min(self._release(t.traj_id), t.length)
                self._debt += self.costs.prefill_seconds(t.length, cached)
                self.times.prefix_hits += cached
                # computed before and again now: all but the cache's and the tokens the
                # environment appended since (an observation is prefilled once anyway)
                again = t.length - cached - _observation_tail(t.payload.mask)
                if t.length > t.prompt_len and again > 0:
                    self.times.reprefill_tokens += again
            t.base, t.start = t.length, self.steps
            self.running[t.traj_id] = t
            self._sum_base += t.base - t.start
            heapq.heappush(self._finish, (t.start + t.end - t.base, t.traj_id))

    def _stop(self, t: SimTrajectory) -> None:
        """Take a running trajectory out of the batch, freezing its length."""
        del self.running[t.traj_id]
        self._sum_base -= t.base - t.start
        t.base, t.start = t.length, -1

    def _hold(self, t: SimTrajectory) -> None:
        """Cache the KV of a trajectory that left the batch unfinished (keep_kv)."""
        if not self.costs.keep_kv or t.traj_id in self.copies:
            return
        self._release(t.traj_id)
        self.held[t.traj_id] = t.length
        self._held_total += t.length
        self._trim()

    def _release(self, tid: int) -> int:
        """Take ``tid``'s prefix out of the cache; its KV tokens (0 if not cached)."""
        n = self.held.pop(tid, 0)
        self._held_total -= n
        return n

    def _trim(self) -> None:
        """Evict cached prefixes, least recently used first, until the cache and the
        decoding batch (with a step of headroom) fit the KV budget."""
        c = self.cost
        room = c.kv_budget - self.kv - c.k5 * len(self.running)
        while self.held and c.k5 * self._held_total > room:
            self._release(next(iter(self.held)))

    def _preempt(self) -> None:
        victim = next(reversed(self.running.values()))
        self._stop(victim)
        self.waiting.insert(0, victim)
        self.times.preemptions += 1

    def _partial(self, t: SimTrajectory) -> PartialTrajectory:
        tokens, logprobs, versions = t.response(self.version)
        return PartialTrajectory(t.traj_id, tokens, logprobs, versions, t.mask())


def _observation_tail(mask: np.ndarray | None) -> int:
    """Tokens at the end of a routed response that the model did not generate (the
    observation appended after its last turn)."""
    if mask is None or len(mask) == 0 or mask[-1]:
        return 0
    model = np.flatnonzero(mask)
    return len(mask) - (int(model[-1]) + 1 if len(model) else 0)


_CONSTANTS: dict[tuple[type, float], np.ndarray] = {}


def constant(dtype: type, value: float, n: int) -> np.ndarray:
    """``n`` copies of ``value``, read-only: a view of one cached array per value (token
    ids and logprobs are constants here, and so are a trajectory's versions while one
    policy generates it; the TS keeps read-only arrays as they are, so the runs share
    them instead of holding a copy per trajectory)."""
    key = (dtype, value)
    arr = _CONSTANTS.get(key)
    if arr is None or len(arr) < n:
        arr = np.full(max(n, 1 << 16, 2 * len(arr) if arr is not None else 0), value, dtype)
        arr.flags.writeable = False
        _CONSTANTS[key] = arr
    return arr[:n]


def is_constant(arr: np.ndarray, dtype: type, value: float) -> bool:
    """Is ``arr`` a view that :func:`constant` made for ``value``?"""
    return arr.base is not None and arr.base is _CONSTANTS.get((dtype, value))


def _steps_within(budget: float, first: float, growth: float) -> int:
    """Most whole steps whose total latency fits ``budget`` (at least one)."""
    if budget <= first:
        return 1
    if growth <= 0.0:
        return max(1, int(budget // first))
    b = first - growth / 2.0
    k = int((-b + math.sqrt(b * b + 2.0 * growth * budget)) / growth)
    return max(1, k)
