"""What the coordinator learns about environment waits, and the rules that use it.

Multi-turn (agentic) trajectories alternate model turns, decoded on an instance, with
environment steps (a tool call), during which they hold no decode slot
(``types.InstanceSnapshot.env_trajs``). The cost model and the per-instance speed
estimate describe decoding only: ``run_trajs`` and ``kv_cache`` never include a waiting
trajectory, and nothing here changes Eq. 2. What the strategies add is the time a
trajectory will still spend waiting, learned online from the snapshots:

- :class:`ToolWaits` measures each wait as the time a trajectory is listed in some
  instance's ``env_trajs`` (from its first listing to the first snapshot without it, so
  to within a period), keeps the last ``window`` waits, and answers the empirical
  conditional questions the rules ask: will a trajectory that has waited ``w`` seconds
  be back within ``h`` (``p_return``), and for how much longer will it wait
  (``residual``)? Heavy-tailed tool latencies make both depend on ``w``: a call that has
  already run long is likely to run longer still. It also learns the tokens a model
  turn decodes (from a trajectory's length when it is back in the TS after a wait to its
  length at its next wait). One run trains one task, so one estimator is per task.
- :func:`stays_home` (KV locality): a next turn goes back to the instance that caches its
  prefix unless the cost model says that moving it is faster.
- :func:`expected_returns` (admission): the decode load each instance will get back
  from its waiting trajectories within a turn's time, which new trajectories must leave
  room for.
- the synchronisation (``sync.ThroughputSync.kv_in_use``) weighs a Pull by what it
  discards: the decoding KV and the cached prefixes expected back within a turn's time
  (:func:`expected_returns`). An instance whose trajectories wait on long tool calls,
  whose caches eviction would likely take anyway, is cheap to Pull and is Pulled then.

Pure: fed snapshots and TS views, it returns numbers; no clock of its own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.types import Snapshot, TrajectoryView
from staleness.types import TrajId

FloatArray = npt.NDArray[np.float64]


class ToolWaits:
    """Online environment waits and turn sizes (module docstring).

    ``prior_wait_s`` and ``prior_turn_tokens`` answer until ``min_samples`` waits (turns)
    were measured; the wait prior is an exponential distribution of that mean.
    """

    def __init__(
        self,
        *,
        window: int = 1024,
        min_samples: int = 16,
        prior_wait_s: float = 5.0,
        prior_turn_tokens: float = 256.0,
    ) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError(f"window ({window}) and min_samples ({min_samples}) must be >= 1")
        if not prior_wait_s > 0 or not prior_turn_tokens > 0:
            raise ValueError("the priors must be > 0")
        self.min_samples = min_samples
        self.prior_wait_s = prior_wait_s
        self.prior_turn_tokens = prior_turn_tokens
        self._waits: deque[float] = deque(maxlen=window)
        self._turns: deque[int] = deque(maxlen=window)
        self._sorted: FloatArray | None = None
        self._turn_mean: float | None = None  # turn_tokens(), until a turn is added
        self._since: dict[TrajId, float] = {}  # waiting now -> first listed at
        self._back: dict[TrajId, int] = {}  # back from a wait -> length when first seen back
        self._left: set[TrajId] = set()  # left a wait, not seen in the TS yet
        self._now = 0.0

    # -- learning -----------------------------------------------------------------------

    def observe(self, snapshot: Snapshot, ts_trajs: Sequence[TrajectoryView]) -> None:
        """One validated snapshot and the TS's routing view of the same cycle."""
        now = self._now = snapshot.taken_at
        since, back = self._since, self._back
        # every cycle lists a third of the trajectories in flight, most of them listed
        # before: the new ones are found by comprehensions, in snapshot order
        waiting = {t.traj_id: t for s in snapshot.instances for t in s.env_trajs}
        for tid in [tid for tid in waiting if tid not in since]:
            since[tid] = now
            start = back.pop(tid, None)
            length = waiting[tid].length
            if start is not None and length > start:
                self._turns.append(length - start)
                self._turn_mean = None
        if len(waiting) < len(since):
            for tid in [t for t in since if t not in waiting]:
                self._waits.append(now - since.pop(tid))
                self._sorted = None
                self._left.add(tid)
        if self._left:
            left = self._left
            for t in ts_trajs:
                if t.traj_id in left:
                    back[t.traj_id] = t.length
                    left.discard(t.traj_id)
            if len(left) > 4 * len(since) + 1024:
                left.clear()  # completed or dropped before they were seen back
        if len(back) > 4 * len(since) + 1024:
            back.clear()  # turns that ended the episode leave no next wait

    def learn(self, waits: Sequence[float] = (), turn_tokens: Sequence[int] = ()) -> None:
        """Add measured waits (seconds) and turn sizes (tokens) directly, e.g. from an
        earlier run of the same task."""
        if any(not w >= 0 for w in waits) or any(n < 1 for n in turn_tokens):
            raise ValueError("waits must be >= 0 seconds and turns >= 1 token")
        self._waits.extend(float(w) for w in waits)
        self._turns.extend(int(n) for n in turn_tokens)
        self._sorted = None
        self._turn_mean = None

    # -- what the rules ask -------------------------------------------------------------

    @property
    def samples(self) -> int:
        return len(self._waits)

    def waited(self, traj_id: TrajId) -> float:
        """Seconds ``traj_id`` has been waiting at the last snapshot (0 if not waiting)."""
        t = self._since.get(traj_id)
        return 0.0 if t is None else self._now - t

    def waited_all(self, traj_ids: Sequence[TrajId]) -> FloatArray:
        """:meth:`waited` of each of ``traj_ids``."""
        now, get = self._now, self._since.get
        return np.array([now - get(t, now) for t in traj_ids], dtype=np.float64)

    def turn_tokens(self) -> float:
        """Mean tokens a model turn decodes."""
        if len(self._turns) < self.min_samples:
            return self.prior_turn_tokens
        # KV-locality routing asks once per next turn: the sum over the window is kept
        # until a turn is added
        if self._turn_mean is None:
            self._turn_mean = float(sum(self._turns)) / len(self._turns)
        return self._turn_mean

    def p_return(self, waited: float | FloatArray, horizon: float | FloatArray) -> FloatArray:
        """P(a wait ends within ``horizon`` more seconds | it lasted ``waited`` so far)."""
        w = np.asarray(waited, dtype=np.float64)
        h = np.asarray(horizon, dtype=np.float64)
        waits = self._waits_sorted()
        if waits is None:  # exponential prior: memoryless
            out: FloatArray = 1.0 - np.exp(-h / self.prior_wait_s) + 0.0 * w
            return out
        n = len(waits)
        beyond = n - np.searchsorted(waits, w, side="right")
        within = np.searchsorted(waits, w + h, side="right") - (n - beyond)
        # a wait longer than any measured: the last measured tail, one pseudo-count
        out = (within + 0.5 * (beyond == 0)) / np.maximum(beyond, 1.0)
        return np.clip(out, 0.0, 1.0)

    def residual(self, waited: float) -> float:
        """E[remaining wait | it lasted ``waited`` so far] (seconds)."""
        waits = self._waits_sorted()
        if waits is None:
            return self.prior_wait_s
        tail = waits[np.searchsorted(waits, waited, side="right") :]
        if len(tail) == 0:  # beyond every measured wait: at least as long again
            return max(waited, float(waits[-1]))
        return float(tail.mean()) - waited

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the measured waits (the prior's until enough)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q={q} must be in [0, 1]")
        waits = self._waits_sorted()
        if waits is None:
            return -self.prior_wait_s * math.log(max(1e-12, 1.0 - q))
        return float(np.quantile(waits, q))

    def _waits_sorted(self) -> FloatArray | None:
        if len(self._waits) < self.min_samples:
            return None
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._waits, dtype=np.float64))
        return self._sorted


def move_penalty(
    cost: CostModel, length: float, cached: float, n_dest: float, latency_dest: float
) -> float:
    """Tokens a move costs the fleet, compared with the instance caching the prefix: the
    destination prefills ``length - cached`` more tokens, during which its batch of
    ``n_dest`` and the trajectory itself make no step (``latency_dest`` seconds each)."""
    extra = cost.prefill_seconds(length) - cost.prefill_seconds(length, cached)
    return extra * (n_dest + 1.0) / latency_dest


def stays_home(
    cost: CostModel,
    *,
    gain_home: float,
    gain_best: float,
    length: float,
    cached: float,
    n_best: float,
    latency_best: float,
    turn_tokens: float,
) -> bool:
    """KV locality: does a next turn go back to the instance caching its prefix?

    Over the turn (``turn_tokens`` decode steps, each ``latency_best`` seconds where it
    would move) a move adds ``gain_best - gain_home`` tokens/s to the fleet's throughput
    (Eq. 3 at both, with their speeds) and costs :func:`move_penalty` tokens. It stays
    unless the first is larger. A home that cannot run it now (``gain_home`` is -inf: no
    KV room, or a queue) loses it: waiting there helps nobody.
    """
    if gain_home == -math.inf:
        return False
    if gain_best <= gain_home:
        return True
    gained = (gain_best - gain_home) * turn_tokens * latency_best
    return gained <= move_penalty(cost, length, cached, n_best, latency_best)


def fleet_has_room(fleet: Fleet, cost: CostModel, share: float) -> bool:
    """Is the fleet's mean KV in use under ``share`` of the budget? Then every instance
    has room, and a next turn moved off its cache gains the fleet no throughput it could
    not have at home, while its prefill is paid (KV locality's ``home_below``; at eta = 1
    on `swe-agent` the cost model's moves cost 1.7-2.7%: docs/simulator_agentic.md)."""
    return share > 0.0 and len(fleet) > 0 and float(fleet.kv.mean()) < share * cost.kv_budget


def expected_returns(
    fleet: Fleet, waits: ToolWaits, cost: CostModel, turns: float = 1.0
) -> tuple[FloatArray, FloatArray]:
    """Per instance, the expected decoding trajectories and KV tokens that come back from
    their environment within a turn's time, by KV locality: a waiting trajectory whose
    prefix an instance caches is expected there with probability ``p_return(waited, h)``,
    ``h`` being that instance's step latency times the tokens of a turn (the time a
    trajectory admitted now decodes its first turn there, sharing the batch with what
    returns meanwhile). Trajectories no instance caches come back to wherever routing
    sends them and load no one in particular."""
    n = np.zeros(len(fleet))
    kv = np.zeros(len(fleet))
    if not fleet.held or not fleet.n_env.any():
        return n, kv
    where, lengths, ids = fleet.at_home()
    if not len(where):
        return n, kv
    horizon = fleet.latencies(cost) * waits.turn_tokens() * turns
    p = waits.p_return(waits.waited_all(ids), horizon[where])
    # bincount adds in input order, as np.add.at did: the same floats, faster
    n = np.bincount(where, p, len(fleet))
    kv = np.bincount(where, p * cost.k5 * np.array(lengths, dtype=np.float64), len(fleet))
    return n, kv
