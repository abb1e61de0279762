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
AHEAD = 34
LOOK = 64
MAX_DIRTY = 32


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
    """Gains of instances laid out in version-bucket order (``starts``/``ends``).

    The loads are kept as Python floats (``_nl`` .. ``_hrl``: what :meth:`place`, run once
    per route, reads and writes; a numpy scalar read or write costs several times a list
    item's) and copied into the numpy arrays the vector expressions read only when one is
    computed (``_stale``: an instance was routed to since)."""

    __slots__ = (
        "_a1",
        "_a1l",
        "_ahead",
        "_bucket",
        "_coeffs",
        "_col0",
        "_cursor",
        "_dirty",
        "_dirty_in",
        "_fill",
        "_fill_on",
        "_first",
        "_fresh",
        "_g",
        "_headroom",
        "_hrl",
        "_k1k5",
        "_kv",
        "_kvl",
        "_length",
        "_n",
        "_nl",
        "_nrows",
        "_num",
        "_numl",
        "_plan",
        "_row",
        "_rows_at",
        "_scratch",
        "_stale",
        "_t0",
        "_t0l",
        "_top",
        "_val",
        "_w",
        "_wl",
        "cost",
        "ends",
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
        self._n, self._kv = n, kv
        self._k1k5 = cost.k1 * cost.k5  # the operation order matches CostModel.marginal_gains
        # place() runs once per route: the constants, and the cost model's step term
        # (CostModel.decode_term, the part speculation changes) where it speculates
        term = cost.decode_term if cost.speculation is not None else None
        self._coeffs = (cost.k1, cost.k2, cost.k3, cost.k4, cost.k5, cost.kv_budget, term)
        self._w = np.ones(len(n)) if weight is None else weight
        self._wl: list[float] = self._w.tolist()
        self._stale = False
        self._loads()
        self._headroom[queued] = -np.inf  # Eq. 3: a queued engine takes nothing at once
        self._hrl = self._headroom.tolist()
        self._bucket: list[int] = [0] * len(n)  # bucket of every position
        for b, (s, e) in enumerate(zip(starts, ends, strict=True)):
            self._bucket[s:e] = [b] * (e - s)
        self._fill = fill_steps
        self._fill_on = fill_steps is not None
        self._scratch = np.empty(len(n))
        self._g = self._scratch  # gains for self._length (the vector path)
        self._length = -1.0
        self._fresh = len(starts)  # buckets >= this one hold gains for self._length
        # The lengths the next decisions ask for (plan()), and rows of them computed at
        # once (_row: the row of self._length, -1 if it has none): per bucket from the
        # plan's first, per row, its best instance as the loads were then (_top) and that
        # gain (_val): still the best of every instance not routed to since (_dirty_in;
        # _dirty: the same per bucket), whose gains are evaluated on use and read -inf in
        # the rows (_ahead) from then on.
        self._plan: list[float] = []
        self._first = 0  # the plan's lowest bucket: the rows hold no gains below it
        self._cursor = 0
        self._row = -1
        self._ahead: FloatArray | None = None  # the rows' gains, from column _col0 on
        self._col0 = 0
        self._top: list[list[int]] = []
        self._val: list[list[float]] = []
        self._rows_at = 0
        self._nrows = 0
        self._dirty_in: set[int] = set()
        self._dirty: list[list[int]] = [[] for _ in starts]

    @property
    def n(self) -> FloatArray:
        """Trajectories running on each instance, the routes so far included."""
        self._sync()
        return self._n

    @property
    def kv(self) -> FloatArray:
        """KV tokens of each instance, the routes so far included."""
        self._sync()
        return self._kv

    def n_at(self, j: int) -> float:
        """``n[j]``, without copying the loads into the arrays."""
        return self._nl[j]

    def _loads(self) -> None:
        """The parts of Eq. 3 that depend on the loads alone (module docstring): with one
        more trajectory, the step's latency minus the new KV (``_a1``) and the tokens the
        batch keeps per step (``_num``: ``n + 1`` times what each keeps, 1 without
        speculation), ``T(S)``, the KV headroom; and the same as Python floats."""
        n, kv, cost = self._n, self._kv, self.cost
        np1 = n + 1.0
        a1, kept1 = cost.steps(np1, kv)
        self._a1 = a1
        self._num = np1 * kept1
        self._t0 = cost.throughputs(n, kv)
        self._headroom = cost.kv_budget - kv
        self._nl, self._kvl = n.tolist(), kv.tolist()
        self._a1l, self._numl, self._t0l = a1.tolist(), self._num.tolist(), self._t0.tolist()

    def _sync(self) -> None:
        """Copy the loads into the arrays if an instance was routed to since the last
        copy (whole: a list of a few hundred floats becomes an array in one C loop, which
        costs less than writing the few routed-to items one by one)."""
        if not self._stale:
            return
        self._stale = False
        self._n, self._kv = np.array(self._nl), np.array(self._kvl)
        self._a1, self._num = np.array(self._a1l), np.array(self._numl)
        self._t0, self._headroom = np.array(self._t0l), np.array(self._hrl)

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
        as one matrix instead, with each row's best instance per bucket. A route changes
        only its own instance's gains, so while a row's best was not routed to since, the
        answer is that instance or one of those routed to (their gains evaluated in
        Python, exactly as :meth:`place` computes them), and no numpy call is made; else
        the best of the rest is the row's argmax, as a route sets its instance's gains in
        the rows to -inf, and is compared with theirs the same way. So the answers are the
        ones :meth:`best` gives without a plan, bit for bit, ties included
        (tests/coordinator/test_routing_rules.py). ``first``: the lowest bucket the
        decisions ask about (rows start there; a lower one is computed on demand)."""
        self._plan = lengths
        self._first = first
        self._cursor = 0
        self._ahead = None
        self._length = -1.0

    def best(self, b: int, length: float) -> tuple[int, float]:
        """(index, gain) of the best instance of bucket ``b`` for a trajectory of ``length``;
        the gain is ``-inf`` where the trajectory would have to queue."""
        if length != self._length:
            self._length = length
            self._row = self._plan_row(length)
            if self._row < 0:
                self._g = self._scratch
                self._fresh = len(self.starts)
        if self._row >= 0:
            if b >= self._first:
                return self._planned(b, length)
            self._g = self._scratch  # below the rows: this bucket alone, every time
            self._vector(b, b + 1, length)
        elif b < self._fresh:
            # The waterfall only moves to newer buckets, so compute every bucket from b on
            # at once: one vector expression costs about the same as a bucket's.
            self._vector(b, self._fresh, length)
            self._fresh = b
        s, e = self.starts[b], self.ends[b]
        g = self._g
        j = s if e - s == 1 else s + int(g[s:e].argmax())
        return j, float(g[j])

    def _vector(self, b: int, stop_b: int, length: float) -> None:
        """Gains for ``length`` of buckets ``b`` to ``stop_b`` (excluded) into ``_g``."""
        self._sync()
        s = self.starts[b]
        stop = self.starts[stop_b] if stop_b < len(self.starts) else len(self._n)
        view = self._g[s:stop]
        np.divide(self._num[s:stop], self._a1[s:stop] + self._k1k5 * length, out=view)
        view -= self._t0[s:stop]
        view *= self._w[s:stop]
        need = self.cost.k5 * length
        if self._fill_on:
            assert self._fill is not None
            growth = self.cost.k5 * (self._n[s:stop] + 1.0) * self._fill
            np.add(view, FILL_BONUS, out=view, where=self._headroom[s:stop] >= need + growth)
        np.copyto(view, -np.inf, where=self._headroom[s:stop] < need)

    def _planned(self, b: int, length: float) -> tuple[int, float]:
        """:meth:`best` from the planned row ``_row`` (:meth:`plan`)."""
        r = self._row
        dirty = self._dirty[b]
        i = b - self._first
        j, g = self._top[i][r], self._val[i][r]
        if not dirty:
            return j, g
        dirty_in = self._dirty_in
        if j in dirty_in:
            # the row's argmax, where those routed to since read -inf (place): the best of
            # the rest, or the bucket's first if every gain is -inf (then so is the answer
            # unless one routed to since gains more, and ties go to the lowest position)
            assert self._ahead is not None
            c = self._col0
            row = self._ahead[r]
            s = self.starts[b] - c
            j = s + int(row[s : self.ends[b] - c].argmax())
            j, g = j + c, float(row[j])
        # the best of the rest is j: compare the current gains of those routed to since,
        # in Python floats with the vector expression's IEEE operations in its order
        # (inlined: this runs for every one of them on every decision)
        k5, hrl, nl = self.cost.k5, self._hrl, self._nl
        numl, a1l, t0l, wl = self._numl, self._a1l, self._t0l, self._wl
        need, x = k5 * length, self._k1k5 * length
        fill = self._fill if self._fill_on else None
        for d in dirty:
            headroom = hrl[d]
            if headroom < need:
                gd = -np.inf
            else:
                gd = (numl[d] / (a1l[d] + x) - t0l[d]) * wl[d]
                if fill is not None and headroom >= need + k5 * (nl[d] + 1.0) * fill:
                    gd += FILL_BONUS
            if gd > g or (gd == g and d < j):
                j, g = d, gd
        return j, g

    def _plan_row(self, length: float) -> int:
        """The row of the planned rows for ``length`` if the plan has it next (within
        :data:`LOOK`), computing the next rows if needed (:meth:`plan`); -1 if not."""
        plan, p = self._plan, self._cursor
        if not plan:
            return -1
        if p >= len(plan) or plan[p] != length:
            try:
                p = plan.index(length, p, p + LOOK)
            except ValueError:
                return -1
            self._cursor = p
        r = p - self._rows_at
        if self._ahead is None or not 0 <= r < self._nrows or len(self._dirty_in) > MAX_DIRTY:
            self._compute_ahead(p)
            r = 0
        return r

    def _compute_ahead(self, p: int) -> None:
        """Rows for the lengths ``plan[p:p + AHEAD]``: the gains of every instance, in the
        operations and order of :meth:`best`'s vector expression, and per bucket each
        row's best instance and its gain."""
        self._sync()
        lengths = self._plan[p : p + AHEAD]
        c = self.starts[self._first] if self._first < len(self.starts) else len(self._n)
        ls = np.array(lengths, dtype=np.float64)[:, None]
        out = np.divide(self._num[c:], self._a1[c:] + self._k1k5 * ls)
        out -= self._t0[c:]
        out *= self._w[c:]
        need = self.cost.k5 * ls
        headroom = self._headroom[c:]
        if self._fill_on:
            assert self._fill is not None
            growth = self.cost.k5 * (self._n[c:] + 1.0) * self._fill
            np.add(out, FILL_BONUS, out=out, where=headroom >= need + growth)
        np.copyto(out, -np.inf, where=headroom < need)
        tops, vals = [], []
        for b in range(self._first, len(self.starts)):
            bucket = out[:, self.starts[b] - c : self.ends[b] - c]
            best = bucket.argmax(axis=1)
            gain = bucket[np.arange(len(lengths)), best]
            at = self.starts[b]
            tops.append((best + at).tolist())
            vals.append(gain.tolist())
        self._ahead, self._col0 = out, c
        self._top, self._val = tops, vals
        self._rows_at, self._nrows = p, len(lengths)
        self._dirty_in = set()
        self._dirty = [[] for _ in self.starts]

    def gain_at(self, j: int, length: float) -> float:
        """The gain of instance ``j`` for a trajectory of ``length`` without the fill rule
        (Eq. 3 over its speed; ``-inf`` where it would queue)."""
        if self._hrl[j] < self.cost.k5 * length:
            return -np.inf
        return (self._numl[j] / (self._a1l[j] + self._k1k5 * length) - self._t0l[j]) * self._wl[j]

    def latency_with(self, j: int, length: float) -> float:
        """Instance ``j``'s seconds per token of each running trajectory (its step
        latency, over the tokens a step keeps with speculation), its speed included, with
        one more trajectory of ``length`` tokens."""
        step = self._a1l[j] + self._k1k5 * length
        kept = self._numl[j] / (self._nl[j] + 1.0)  # 1.0 without speculation
        return step / kept / self._wl[j]

    def load(self, dn: FloatArray, dkv: FloatArray) -> None:
        """Add ``dn`` trajectories and ``dkv`` KV tokens to every instance (negative to
        take them off again): load the decisions that follow must leave room for."""
        self._sync()
        self._n += dn
        self._kv += dkv
        queued = self._headroom == -np.inf
        self._loads()
        self._headroom[queued] = -np.inf
        self._hrl = self._headroom.tolist()
        self._length = -1.0  # cached gains were for the old loads
        self._ahead = None

    def place(self, j: int, length: float) -> None:
        """Eq. 3's update of ``S`` after routing a trajectory of ``length`` to ``j``."""
        k1, k2, k3, k4, k5, budget, term = self._coeffs
        n = self._nl[j] + 1.0
        kv = self._kvl[j] + k5 * length
        # CostModel.step and .throughput, inlined: this runs once per route, and without
        # speculation decode_term is max(k2, k3 * n) and 1.0, written out (two calls
        # doubled the time of a route; test_gains holds the two to the same floats)
        if term is None:
            top1, top0, kept1, kept0 = k3 * (n + 1.0), k3 * n, 1.0, 1.0
            top1, top0 = (k2 if k2 > top1 else top1), (k2 if k2 > top0 else top0)
        else:
            (top1, kept1), (top0, kept0) = term(n + 1.0), term(n)
        self._nl[j], self._kvl[j] = n, kv
        self._a1l[j] = a1 = k1 * kv + top1 + k4
        self._numl[j] = num1 = (n + 1.0) * kept1
        self._t0l[j] = t0 = n * kept0 / (k1 * kv + top0 + k4)
        self._hrl[j] = headroom = budget - kv
        self._stale = True
        if self._ahead is not None and j not in self._dirty_in:
            self._dirty_in.add(j)
            self._dirty[self._bucket[j]].append(j)
            if j >= self._col0:  # its gains in the rows are gone (_planned)
                self._ahead[:, j - self._col0] = -np.inf
        if length != self._length:
            self._length = -1.0  # the gains kept were for another length
        elif self._row < 0:
            fits = headroom >= k5 * length
            gain = (num1 / (a1 + self._k1k5 * length) - t0) * self._wl[j]
            if self._fill_on and headroom >= k5 * length + k5 * (n + 1.0) * (self._fill or 0):
                gain += FILL_BONUS
            self._g[j] = gain if fits else -np.inf
