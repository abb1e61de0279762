"""Eq. 3 marginal gains for the routing loop, computed lazily and updated incrementally.

Routing asks, for one trajectory length at a time, "which instance of version group ``b``
gains most?". The parts of Eq. 3 that do not depend on the length (``T(S)``, and the
latency of ``S'`` without the new tokens) are kept per instance and change only for the
instance that receives a route, so a new length costs one short vector expression per
version group actually visited, and a route costs O(1). Where the lengths to come are
known (:meth:`GainTable.plan`: a level of partial trajectories, each of its own length),
the next ones are computed together as a matrix, as the numpy calls' overhead, not their
arithmetic, is what a length costs at a few hundred instances.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from coordinator.cost_model import CostModel

FloatArray = npt.NDArray[np.float64]

# Added to the gain of an instance that has KV to spare for the new trajectory (the fill
# rule, :func:`spare`): it then beats every instance without and clears any threshold, and
# instances with spare KV still compare by their gains. Gains are tokens/s per trajectory
# (at most ~100), so the bonus keeps them apart by ~1e-7 at worst.
FILL_BONUS = 1.0e9

# GainTable.plan: rows computed at once, how far ahead in the plan a length is looked
# for, and how many routed-to instances a row may be fixed for before the next rows are
# computed afresh instead (each costs a Python evaluation per row).
AHEAD = 24
LOOK = 64
MAX_DIRTY = 12


def spare(
    cost: CostModel,
    n: FloatArray,
    kv: FloatArray,
    length: float | FloatArray,
    fill_steps: int,
) -> npt.NDArray[np.bool_]:
    """The fill rule's test: with a new trajectory of ``length``, the KV cache would still
    hold ``fill_steps`` more decode steps of the whole batch (``n + 1`` trajectories, each
    growing by ``k5`` per step) within the budget. Below that the instance is not full and
    withholding work from it only shrinks its batch; the headroom keeps the running
    trajectories from being preempted as they grow."""
    k5 = cost.k5
    out: npt.NDArray[np.bool_] = cost.kv_budget - kv >= k5 * length + k5 * (n + 1.0) * fill_steps
    return out


def routing_gains(
    cost: CostModel,
    n: FloatArray,
    kv: FloatArray,
    queued: npt.NDArray[np.bool_],
    weight: FloatArray,
    length: float | FloatArray,
    fill_steps: int | None,
) -> FloatArray:
    """The gains :class:`GainTable` compares, for many instances at once (and lengths, by
    broadcasting): Eq. 3 over each instance's speed, ``-inf`` where the trajectory would
    queue, plus :data:`FILL_BONUS` where the instance has KV to spare (:func:`spare`;
    ``fill_steps`` None: no fill rule). Same operations in the same order as the table, so
    equal states give equal gains."""
    out: FloatArray = cost.marginal_gains(n, kv, queued, length) * weight
    if fill_steps is not None:
        below = ~queued & spare(cost, n, kv, length, fill_steps)
        out = np.where(below, out + FILL_BONUS, out)
    return out


class GainTable:
    """Gains of instances laid out in version-bucket order (``starts``/``ends``)."""

    __slots__ = (
        "_a1",
        "_ahead",
        "_coeffs",
        "_cursor",
        "_dirty",
        "_fill",
        "_fill_on",
        "_first",
        "_fresh",
        "_g",
        "_headroom",
        "_k1k5",
        "_kvl",
        "_length",
        "_log",
        "_nl",
        "_num",
        "_plan",
        "_rows",
        "_rows_at",
        "_scratch",
        "_t0",
        "_w",
        "_wl",
        "cost",
        "ends",
        "kv",
        "n",
        "starts",
    )

    def __init__(
        self,
        cost: CostModel,
        n: FloatArray,
        kv: FloatArray,
        queued: npt.NDArray[np.bool_],
        starts: list[int],
        ends: list[int],
        weight: FloatArray | None = None,
        fill_steps: int | None = None,
    ) -> None:
        """``weight``: per instance, ``1 / speed`` (coordinator.estimation); the gain of an
        instance whose steps take ``speed`` times the model's is the model's gain over it.
        ``fill_steps``: the fill rule's headroom in decode steps (:func:`spare`)."""
        self.cost, self.starts, self.ends = cost, starts, ends
        self.n, self.kv = n, kv
        self._k1k5 = cost.k1 * cost.k5  # the operation order matches CostModel.marginal_gains
        # place() runs once per route: the constants, and the cost model's step term
        # (CostModel.decode_term, the part speculation changes) where it speculates
        term = cost.decode_term if cost.speculation is not None else None
        self._coeffs = (cost.k1, cost.k2, cost.k3, cost.k4, cost.k5, cost.kv_budget, term)
        self._loads()
        self._headroom = cost.kv_budget - kv
        self._headroom[queued] = -np.inf  # Eq. 3: a queued engine takes nothing at once
        self._w = np.ones(len(n)) if weight is None else weight
        # n, kv and weight as Python floats too: place() reads them once per route
        self._nl: list[float] = n.tolist()
        self._kvl: list[float] = kv.tolist()
        self._wl: list[float] = self._w.tolist()
        self._fill = fill_steps
        self._fill_on = fill_steps is not None
        self._scratch = np.empty(len(n))
        self._g = self._scratch  # gains for self._length: the scratch or a row of _ahead
        self._length = -1.0
        self._fresh = len(starts)  # buckets >= this one hold gains for self._length
        # The lengths the next decisions ask for (plan()), and the gains of a stretch of
        # them computed at once: rows for plan[_rows_at:_rows_at + len(_ahead)], as they
        # were before the routes since (_log: their instances, in order; _dirty: the same
        # as a set), which a row gets on use (_rows[r]: how much of _log row r has had).
        self._plan: list[float] = []
        self._first = 0  # the plan's lowest bucket: the rows hold no gains below it
        self._cursor = 0
        self._ahead: FloatArray | None = None
        self._rows_at = 0
        self._rows: list[int] = []
        self._log: list[int] = []
        # per instance in _log: (n + 1, its tokens per step, latency of S' minus new KV,
        # T(S), weight, headroom) as Python floats, what a row's fix needs (numpy scalar
        # reads cost more)
        self._dirty: dict[int, tuple[float, float, float, float, float, float]] = {}

    def _loads(self) -> None:
        """The parts of Eq. 3 that depend on the loads alone (module docstring): with one
        more trajectory, the step's latency minus the new KV (``_a1``) and the tokens the
        batch keeps per step (``_num``: ``n + 1`` times what each keeps, 1 without
        speculation), and ``T(S)``."""
        n, kv, cost = self.n, self.kv, self.cost
        np1 = n + 1.0
        a1, kept1 = cost.steps(np1, kv)
        self._a1 = a1
        self._num = np1 * kept1
        self._t0 = cost.throughputs(n, kv)

    def fill_for(self, on: bool) -> None:
        """Apply the fill rule to the next decisions or not (initial trajectories only)."""
        on = on and self._fill is not None
        if on != self._fill_on:
            self._fill_on = on
            self._length = -1.0  # cached gains were computed the other way
            self._ahead = None

    def plan(self, lengths: list[float], first: int = 0) -> None:
        """The trajectory lengths the next decisions will ask :meth:`best` about, in
        order (a hint: a length not in it, or asked out of order, is computed alone).

        Why: a length costs one vector expression over the instances, a dozen numpy
        calls whose overhead, not their arithmetic, is the cost at a few hundred
        instances, and a pass over the TS's partial trajectories asks a new length for
        almost every trajectory. The gains of :data:`AHEAD` planned lengths are computed
        as one matrix instead; a route then changes only its own instance's gains, which
        a row gets in Python, exactly as :meth:`place` computes them, when it is used. So
        the answers are the ones :meth:`best` gives without a plan, bit for bit. ``first``:
        the lowest bucket the decisions ask about (rows start there; a lower one is
        computed on demand)."""
        self._plan = lengths
        self._first = first
        self._cursor = 0
        self._ahead = None

    def best(self, b: int, length: float) -> tuple[int, float]:
        """(index, gain) of the best instance of bucket ``b`` for a trajectory of ``length``;
        the gain is ``-inf`` where the trajectory would have to queue."""
        if length != self._length:
            self._length = length
            if not self._from_plan(length):
                self._g = self._scratch
                self._fresh = len(self.starts)
        s, e = self.starts[b], self.ends[b]
        g = self._g
        if b < self._fresh:
            # The waterfall only moves to newer buckets, so compute every bucket from b on
            # at once: one vector expression costs about the same as a bucket's.
            stop = self.starts[self._fresh] if self._fresh < len(self.starts) else len(g)
            view = g[s:stop]
            np.divide(self._num[s:stop], self._a1[s:stop] + self._k1k5 * length, out=view)
            view -= self._t0[s:stop]
            view *= self._w[s:stop]
            need = self.cost.k5 * length
            if self._fill_on:
                assert self._fill is not None
                growth = self.cost.k5 * (self.n[s:stop] + 1.0) * self._fill
                np.add(view, FILL_BONUS, out=view, where=self._headroom[s:stop] >= need + growth)
            np.copyto(view, -np.inf, where=self._headroom[s:stop] < need)
            self._fresh = b
        j = s if e - s == 1 else s + int(g[s:e].argmax())
        return j, float(g[j])

    def _from_plan(self, length: float) -> bool:
        """Point ``_g`` at the precomputed row for ``length`` if the plan has it next
        (within :data:`LOOK`), computing the next rows if needed (:meth:`plan`)."""
        plan, p = self._plan, self._cursor
        if not plan:
            return False
        if p >= len(plan) or plan[p] != length:
            try:
                p = plan.index(length, p, p + LOOK)
            except ValueError:
                return False
            self._cursor = p
        rows = self._ahead
        r = p - self._rows_at
        if rows is None or not 0 <= r < len(rows) or len(self._dirty) > MAX_DIRTY:
            rows = self._compute_ahead(plan[p : p + AHEAD])
            r = 0
            self._rows_at = p
        row = rows[r]
        log = self._log
        if self._rows[r] < len(log):  # instances routed to since the row was computed
            for j in set(log[self._rows[r] :]):
                row[j] = self._gain1(j, length)
            self._rows[r] = len(log)
        self._g = row
        self._fresh = self._first
        return True

    def _compute_ahead(self, lengths: list[float]) -> FloatArray:
        """Gains for each of ``lengths`` (rows) on every instance, in the operations and
        order of :meth:`best`'s vector expression."""
        c = self.starts[self._first] if self._first < len(self.starts) else len(self.n)
        ls = np.array(lengths, dtype=np.float64)[:, None]
        rows: FloatArray = np.empty((len(lengths), len(self.n)))
        out = rows[:, c:]
        np.divide(self._num[c:], self._a1[c:] + self._k1k5 * ls, out=out)
        out -= self._t0[c:]
        out *= self._w[c:]
        need = self.cost.k5 * ls
        headroom = self._headroom[c:]
        if self._fill_on:
            assert self._fill is not None
            growth = self.cost.k5 * (self.n[c:] + 1.0) * self._fill
            np.add(out, FILL_BONUS, out=out, where=headroom >= need + growth)
        np.copyto(out, -np.inf, where=headroom < need)
        self._ahead = rows
        self._rows = [0] * len(lengths)
        self._log = []
        self._dirty = {}
        return rows

    def _gain1(self, j: int, length: float) -> float:
        """:meth:`best`'s gain for ``length`` of instance ``j``, routed to since the rows
        were computed, in Python floats (the same IEEE operations in the same order as
        the vector expression)."""
        n1, num1, a1, t0, w, headroom = self._dirty[j]
        k5 = self.cost.k5
        need = k5 * length
        if headroom < need:
            return -np.inf
        gain = (num1 / (a1 + self._k1k5 * length) - t0) * w
        if self._fill_on and headroom >= need + k5 * n1 * (self._fill or 0):
            gain += FILL_BONUS
        return gain

    def gain_at(self, j: int, length: float) -> float:
        """The gain of instance ``j`` for a trajectory of ``length`` without the fill rule
        (Eq. 3 over its speed; ``-inf`` where it would queue)."""
        if self._headroom[j] < self.cost.k5 * length:
            return -np.inf
        num1 = float(self._num[j])
        return (num1 / (float(self._a1[j]) + self._k1k5 * length) - float(self._t0[j])) * float(
            self._w[j]
        )

    def latency_with(self, j: int, length: float) -> float:
        """Instance ``j``'s seconds per token of each running trajectory (its step
        latency, over the tokens a step keeps with speculation), its speed included, with
        one more trajectory of ``length`` tokens."""
        step = float(self._a1[j]) + self._k1k5 * length
        kept = float(self._num[j]) / (float(self.n[j]) + 1.0)  # 1.0 without speculation
        return step / kept / float(self._w[j])

    def load(self, dn: FloatArray, dkv: FloatArray) -> None:
        """Add ``dn`` trajectories and ``dkv`` KV tokens to every instance (negative to
        take them off again): load the decisions that follow must leave room for."""
        budget = self._coeffs[5]
        self.n += dn
        self.kv += dkv
        n, kv = self.n, self.kv
        self._nl, self._kvl = n.tolist(), kv.tolist()
        self._loads()
        queued = self._headroom == -np.inf
        self._headroom = budget - kv
        self._headroom[queued] = -np.inf
        self._length = -1.0  # cached gains were for the old loads
        self._ahead = None

    def place(self, j: int, length: float) -> None:
        """Eq. 3's update of ``S`` after routing a trajectory of ``length`` to ``j``."""
        k1, k2, k3, k4, k5, budget, term = self._coeffs
        n = self._nl[j] + 1.0
        kv = self._kvl[j] + k5 * length
        self._nl[j], self._kvl[j] = n, kv
        self.n[j], self.kv[j] = n, kv
        # CostModel.step and .throughput, inlined: this runs once per route, and without
        # speculation decode_term is max(k2, k3 * n) and 1.0, written out (two calls
        # doubled the time of a route; test_gains holds the two to the same floats)
        if term is None:
            top1, top0, kept1, kept0 = k3 * (n + 1.0), k3 * n, 1.0, 1.0
            top1, top0 = (k2 if k2 > top1 else top1), (k2 if k2 > top0 else top0)
        else:
            (top1, kept1), (top0, kept0) = term(n + 1.0), term(n)
        self._a1[j] = a1 = k1 * kv + top1 + k4
        self._num[j] = num1 = (n + 1.0) * kept1
        self._t0[j] = t0 = n * kept0 / (k1 * kv + top0 + k4)
        self._headroom[j] = headroom = budget - kv
        if self._ahead is not None:
            self._log.append(j)
            self._dirty[j] = (n + 1.0, num1, a1, t0, self._wl[j], headroom)
        if length == self._length:
            fits = headroom >= k5 * length
            gain = (num1 / (a1 + self._k1k5 * length) - t0) * self._wl[j]
            if self._fill_on and headroom >= k5 * length + k5 * (n + 1.0) * (self._fill or 0):
                gain += FILL_BONUS
            self._g[j] = gain if fits else -np.inf
