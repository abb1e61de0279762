"""Exact admission arithmetic for the virtual staleness buffers.

Why counts suffice. The trainer's version ``v`` is the next buffer it consumes and no
policy newer than ``v`` exists, so every tracked group has ``V <= v`` and its admissible
buffers form a *prefix* window ``[v, V + eta]``. Number buffers from the trainer's
(``j = V_buf - v``) and call ``d = V + eta - v`` a group's *deadline*: it may sit in any
buffer ``0..d``.

Occupied groups are committed to a buffer (``pinned``): they only ever move *earlier*
(Occupy and Abort repack them, Figure 7 right and Figure 8c) and a Reserve never pushes
one later: that would make the trainer wait for a trajectory admitted after its batch
was complete. Reserved groups are placeholders and may sit anywhere in their window. So
with ``Y(<=k)`` occupied groups pinned in buffers ``0..k`` and ``R(<=k)`` reserved groups
with deadline ``<= k``, the reserved groups fit (Hall's condition on prefix windows) iff::

    slack(k) = cap * (k + 1) - Y(<=k) - R(<=k) >= 0   for every k.

A new reserved group with deadline ``d`` fits iff ``slack(k) >= 1`` for all ``k >= d``:
the admissible deadlines form an interval ``[d_min, eta]`` and ``verify`` is O(1) between
mutations. Repacking occupied groups is a greedy over prefix sums (``repack``), O(eta).
"""

from __future__ import annotations

_NEG = -(1 << 62)


class AdmissionCounts:
    """Reserved groups per version and occupied groups per buffer, in two rings.

    ``reserved[V % n]``: reserved groups of version ``V`` (``v - eta <= V <= v``).
    ``pinned[b % n]``: occupied groups committed to buffer ``b`` (``v <= b <= v + eta``).
    """

    __slots__ = (
        "_d_min",
        "_dirty",
        "_n",
        "batch_size",
        "capacity",
        "eta",
        "pinned",
        "reserved",
        "version",
    )

    def __init__(self, eta: int, batch_size: int, capacity: int, version: int) -> None:
        self.eta = eta
        self.batch_size = batch_size
        self.capacity = capacity
        self.version = version
        self._n = eta + 1
        self.reserved = [0] * self._n
        self.pinned = [0] * self._n
        self._dirty = True
        self._d_min = 0

    def copy(self) -> AdmissionCounts:
        other = AdmissionCounts.__new__(AdmissionCounts)
        other.eta, other.batch_size, other.capacity = self.eta, self.batch_size, self.capacity
        other.version, other._n = self.version, self._n
        other.reserved = self.reserved.copy()
        other.pinned = self.pinned.copy()
        other._dirty, other._d_min = self._dirty, self._d_min
        return other

    # -- mutation (O(1); callers keep the state feasible) -----------------------------

    def add_reserved(self, v: int, delta: int = 1) -> None:
        self.reserved[v % self._n] += delta
        self._dirty = True

    def add_pinned(self, buffer: int, delta: int = 1) -> None:
        self.pinned[buffer % self._n] += delta
        self._dirty = True

    def advance(self) -> None:
        """The trainer consumed buffer ``version``: the window slides by one."""
        n = self._n
        if self.reserved[(self.version - self.eta) % n] or self.pinned[self.version % n]:
            raise AssertionError("advance() while groups of the consumed window are tracked")
        self.version += 1
        self._dirty = True

    # -- views by buffer index j = V_buf - version ----------------------------------------

    def deadline(self, v: int) -> int:
        return v + self.eta - self.version

    def reserved_by_deadline(self) -> list[int]:
        n, base = self._n, self.version - self.eta
        return [self.reserved[(base + k) % n] for k in range(n)]

    def pinned_by_buffer(self) -> list[int]:
        n, base = self._n, self.version
        return [self.pinned[(base + j) % n] for j in range(n)]

    def slack(self) -> list[int]:
        cap = self.capacity
        r, y = self.reserved_by_deadline(), self.pinned_by_buffer()
        out, used = [], 0
        for k in range(self._n):
            used += r[k] + y[k]
            out.append(cap * (k + 1) - used)
        return out

    # -- queries ------------------------------------------------------------------------

    def head_ready(self) -> bool:
        return self.pinned[self.version % self._n] >= self.batch_size

    def admissible(self, v: int) -> bool:
        d = v + self.eta - self.version
        if d < 0:
            return False
        if self._dirty:
            self._refresh()
        return d >= self._d_min

    def admissible_lowering(self, v_old: int, v_new: int) -> bool:
        """May a reserved group move from version ``v_old`` down to ``v_new``?"""
        d_new, d_old = self.deadline(v_new), self.deadline(v_old)
        if d_new < 0:
            return False
        slack = self.slack()
        return all(slack[k] >= 1 for k in range(d_new, d_old))

    def _refresh(self) -> None:
        n, cap = self._n, self.capacity
        base_r, base_p = self.version - self.eta, self.version
        r, p = self.reserved, self.pinned
        used = 0
        slack = [0] * n
        for k in range(n):
            used += r[(base_r + k) % n] + p[(base_p + k) % n]
            slack[k] = cap * (k + 1) - used
        d_min = n
        for k in range(n - 1, -1, -1):
            if slack[k] < 1:
                break
            d_min = k
        self._d_min = d_min
        self._dirty = False

    # -- repacking occupied groups -----------------------------------------------------

    def repack(self, extra_at: int | None = None) -> list[int] | None:
        """Lexicographically earliest occupied counts per buffer, or None if impossible.

        Occupied groups only move earlier. ``extra_at``: a group about to be occupied whose
        latest admissible buffer index is ``extra_at`` (its deadline). The greedy maximises
        every prefix sum at once: ``Y'(j) = min(Y'(j-1) + batch, min_{k>=j} U(k), total)``
        with ``U(k) = cap*(k+1) - R(<=k)``; it is valid iff it never falls below the groups
        that must already sit at or before ``j``.
        """
        n, cap, batch = self._n, self.capacity, self.batch_size
        base_r, base_p = self.version - self.eta, self.version
        reserved, pinned = self.reserved, self.pinned
        y = [pinned[(base_p + j) % n] for j in range(n)]
        if extra_at is not None:
            if extra_at < 0:
                return None
            y[extra_at] += 1
        total = sum(y)
        u = [0] * n
        r_cum = 0
        for k in range(n):
            r_cum += reserved[(base_r + k) % n]
            u[k] = cap * (k + 1) - r_cum
        for k in range(n - 2, -1, -1):
            if u[k + 1] < u[k]:
                u[k] = u[k + 1]
        out = [0] * n
        prev = forced = 0
        for j in range(n):
            forced += y[j]
            cum = prev + batch
            if u[j] < cum:
                cum = u[j]
            if total < cum:
                cum = total
            if cum < forced:
                return None
            out[j] = cum - prev
            prev = cum
        return out
