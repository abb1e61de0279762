"""The staleness manager: Reserve / Occupy / Consume / Abort on virtual staleness buffers.

Paper §4. The manager tracks every in-flight group (its members' ``V_traj`` and which of
them completed) and keeps the invariant that all tracked groups fit in the buffers
``version .. version + eta``:

- reserved groups are placeholders: any buffer of their window will do, and admission is
  decided exactly from counts (``staleness.feasibility``);
- occupied groups are committed to a buffer and only ever move earlier: after every
  Occupy, Abort, Filter and Consume they are repacked lexicographically earliest (the
  entry movement of Figure 7 right and Figure 8c). The trainer consumes the trainer's
  buffer.

Thread safety: every public method holds one lock, so a trainer thread may block in
``wait_ready`` while the control plane mutates the state.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from staleness import checkpoint, explain
from staleness.errors import (
    DuplicateTrajectory,
    InvalidConfig,
    NotOccupied,
    NotReady,
    NotReserved,
    StalenessViolation,
    UnknownGroup,
)
from staleness.layout import canonical_buffers
from staleness.sketch import CLOSED, Sketch, admits, check_v_traj
from staleness.tracking import REMEMBER_CLOSED, GroupTracker, TrackedGroup
from staleness.types import (
    ConsumedBatch,
    ConsumedGroup,
    GroupId,
    ManagerView,
    Outcome,
    StalenessConfig,
    TrajId,
)

logger = logging.getLogger(__name__)

_EMPTY = Outcome()
_READY = Outcome(ready=True)


class StalenessManager(GroupTracker):
    """Tracks every in-flight group and enforces ``V_traj <= V_buf <= V_traj + eta``."""

    def __init__(self, config: StalenessConfig, version: int = 0) -> None:
        config.check()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidConfig(f"the initial version must be an integer >= 0, got {version!r}")
        self.config = config
        self.eta = config.eta
        self.batch_size = config.batch_size
        self.group_size = config.group_size
        self.capacity = config.buffer_capacity
        self.group_capacity = config.group_capacity
        super().__init__(self.eta, self.batch_size, self.capacity, version)
        self.consumed_batches = 0
        # dynamic sampling: occupied groups filtered out, in all and since the last Consume
        self.filtered_groups = 0
        self.filtered_this_step = 0
        self.history: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=4096)
        self._cond = threading.Condition(threading.Lock())
        self._ready_listeners: list[Callable[[int], None]] = []

    # -- queries ----------------------------------------------------------------------

    def verify(self, v_traj: int, group_id: GroupId | None = None) -> bool:
        """Would a Reserve of a trajectory with this ``V_traj`` succeed? Changes nothing."""
        with self._cond:
            return self._verify(v_traj, group_id)

    def _verify(self, v_traj: int, group_id: GroupId | None) -> bool:
        return admits(self._counts, self._sketch_lookup, v_traj, group_id)

    def is_ready(self) -> bool:
        """Is the trainer's buffer Ready (``batch_size`` occupied groups)?"""
        with self._cond:
            return self._counts.head_ready()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the trainer's buffer is Ready; False on timeout. No busy loop."""
        with self._cond:
            return self._cond.wait_for(self._counts.head_ready, timeout)

    def add_ready_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(version)`` (outside the lock) whenever the trainer's buffer turns
        Ready. For asyncio owners: ``lambda v: loop.call_soon_threadsafe(event.set)``."""
        with self._cond:
            self._ready_listeners.append(callback)

    def group_version(self, group_id: GroupId) -> int | None:
        """The tracked group's version, or None if it is not tracked."""
        with self._cond:
            group = self._groups.get(group_id)
            return None if group is None else group.version

    def is_completed(self, group_id: GroupId, traj_id: TrajId) -> bool:
        """Has this tracked trajectory's completion been applied? False for untracked."""
        with self._cond:
            group = self._groups.get(group_id)
            return group is not None and traj_id in group.completed

    def trainer_groups(self) -> tuple[ConsumedGroup, ...]:
        """The occupied groups of the trainer's buffer so far, in arrival order. Occupied
        groups only ever move earlier, so each stays until it is Consumed: a streaming
        trainer (RolloutPipe) may start on them before the buffer is Ready."""
        with self._cond:
            pinned = self._pinned[self.version % self._n]
            g = self._groups
            return tuple(ConsumedGroup(i, g[i].version, tuple(g[i].completed)) for i in pinned)

    def sketch(self) -> Sketch:
        """A scratch copy of the admission state for one decision cycle (O(eta))."""
        with self._cond:
            return Sketch(self._counts.copy(), self._sketch_lookup)

    def _sketch_lookup(self, group_id: GroupId) -> int | None:
        group = self._groups.get(group_id)
        if group is None:
            return CLOSED if group_id in self._closed else None
        if group.buffer is not None or len(group.members) >= self.group_capacity:
            return CLOSED
        return group.version

    # -- Reserve ----------------------------------------------------------------------

    def reserve(self, group_id: GroupId, traj_id: TrajId, v_traj: int) -> Outcome:
        """Record that an initial trajectory starts generating with ``V_traj = v_traj``.

        The group's first trajectory creates its reserved entry; later members lower the
        group's version to ``min(V_group, v_traj)``. Re-routing a partial trajectory keeps
        its ``V_traj`` and needs no Reserve.
        """
        with self._cond:
            check_v_traj(v_traj)
            group = self._groups.get(group_id)
            if group is not None:
                if traj_id in group.members:
                    raise DuplicateTrajectory(
                        f"trajectory {traj_id} of group {group_id} is already reserved; "
                        "re-routing a partial trajectory needs no Reserve"
                    )
                if group.buffer is not None:
                    raise StalenessViolation(
                        f"group {group_id} already completed its {self.group_size} "
                        f"trajectories; abort trajectory {traj_id} instead of routing it"
                    )
                if len(group.members) >= self.group_capacity:
                    raise StalenessViolation(
                        f"group {group_id} already has {self.group_capacity} trajectories "
                        "reserved (group_size x (1 + group_redundancy))"
                    )
            elif group_id in self._closed:
                raise StalenessViolation(
                    f"group {group_id} was aborted or consumed; drop trajectory {traj_id}"
                )
            if not self._verify(v_traj, group_id):
                raise StalenessViolation(explain.rejection(self._counts, self.eta, v_traj))
            if group is None:
                group = TrackedGroup(v_traj)
                self._groups[group_id] = group
                self._add_reserved(group_id, v_traj)
            elif v_traj < group.version:
                self._remove_reserved(group_id, group.version)
                self._add_reserved(group_id, v_traj)
                group.version = v_traj
            group.members[traj_id] = v_traj
            return _READY if self._counts.head_ready() else _EMPTY

    # -- Occupy -----------------------------------------------------------------------

    def complete(
        self,
        group_id: GroupId,
        traj_id: TrajId,
        keep: Callable[[Sequence[TrajId]], bool] | None = None,
    ) -> Outcome:
        """A trajectory finished and was rewarded. Occupies its group once ``G`` are done.

        ``keep`` (dynamic sampling) is asked, with the ``G`` kept trajectories, when the
        group would be occupied, before anything changes; False filters it instead (as
        :meth:`filter` would once occupied), within this call, so that no reader (a
        streaming trainer, a ready listener) ever sees it occupied. It runs under the
        manager's lock: it must not call the manager.
        """
        with self._cond:
            group = self._groups.get(group_id)
            if group is None:
                if group_id in self._closed:
                    return self._discarded((traj_id,))
                raise UnknownGroup(f"group {group_id} is not tracked (never reserved here)")
            if traj_id not in group.members:
                raise NotReserved(
                    f"trajectory {traj_id} of group {group_id} completed without a Reserve"
                )
            if traj_id in group.completed:
                raise DuplicateTrajectory(
                    f"trajectory {traj_id} of group {group_id} completed twice"
                )
            if group.buffer is not None:  # a surplus member finishing after its group
                return self._discarded((traj_id,))
            group.completed.append(traj_id)
            if len(group.completed) < self.group_size:
                return _READY if self._counts.head_ready() else _EMPTY
            outcome = self._occupy(group_id, group, keep)
        self._notify_if_ready(outcome.ready)
        return outcome

    def _discarded(self, trajs: tuple[TrajId, ...]) -> Outcome:
        """A late call about a group that is settled (aborted, or occupied without these
        members): nothing changes, but the caller still learns whether training may go."""
        return Outcome(discarded=True, abort_trajectories=trajs, ready=self._counts.head_ready())

    def _occupy(
        self,
        group_id: GroupId,
        group: TrackedGroup,
        keep: Callable[[Sequence[TrajId]], bool] | None,
    ) -> Outcome:
        kept = tuple(group.completed)
        new_v = min(group.members[t] for t in kept)
        # Surplus members stay on record so that a late completion is recognised.
        surplus = tuple(t for t in group.members if t not in kept)
        # dynamic sampling decides before anything changes (``keep`` may raise), and only
        # about a group that would be occupied (not batch redundancy's surplus)
        if keep is not None and self._would_fit(group, new_v) and not self._ask(keep, group):
            self._remove_reserved(group_id, group.version)
            self._close_filtered(group_id)
            return Outcome(
                kept=kept,
                abort_trajectories=surplus,
                ready=self._counts.head_ready(),
                filtered=True,
            )
        self._remove_reserved(group_id, group.version)
        layout = self._counts.repack(extra_at=self._counts.deadline(new_v))
        if layout is None:
            # Batch-level redundancy: every occupied slot this group could use is taken.
            self._forget(group_id)
            return Outcome(
                discarded=True,
                abort_trajectories=tuple(group.members),
                abort_groups=(group_id,),
                ready=self._counts.head_ready(),
            )
        group.version = new_v
        self._pin(group_id, group, self.version + self._counts.deadline(new_v))
        self._apply_layout(layout)
        doomed = self._abort_doomed() if self.capacity > self.batch_size else ()
        return Outcome(
            occupied=True,
            kept=kept,
            abort_trajectories=surplus,
            abort_groups=doomed,
            ready=self._counts.head_ready(),
        )

    def _abort_doomed(self) -> tuple[GroupId, ...]:
        """Reserved groups that could never be occupied any more (batch-redundancy surplus)."""
        doomed: list[GroupId] = []
        for k in range(self._n):
            v = self.version - self.eta + k
            bucket = self._reserved[v % self._n]
            if not bucket:
                continue
            trial = self._counts.copy()
            trial.add_reserved(v, -1)
            if trial.repack(extra_at=k) is None:
                for gid in list(bucket):
                    self._remove_reserved(gid, v)
                    self._forget(gid)
                    doomed.append(gid)
        if doomed:
            self._apply_layout(self._repacked())
        return tuple(doomed)

    # -- Abort / filtering ------------------------------------------------------------

    def abort(self, group_id: GroupId) -> Outcome:
        """Drop a reserved or occupied group for good (filtering, redundancy, timeouts).

        Occupied groups of later buffers move forward into the hole (Figure 8c), so the
        trainer's buffer may turn Ready.
        """
        with self._cond:
            group = self._groups.get(group_id)
            if group is None:
                if group_id in self._closed:
                    return self._discarded(())
                raise UnknownGroup(f"group {group_id} is not tracked (never reserved here)")
            # An occupied group's surplus members were already reported at Occupy.
            members = tuple(group.completed if group.buffer is not None else group.members)
            self._untrack(group_id, group)
            self._apply_layout(self._repacked())
            outcome = Outcome(
                abort_trajectories=members,
                abort_groups=(group_id,),
                ready=self._counts.head_ready(),
            )
        self._notify_if_ready(outcome.ready)
        return outcome

    def filter(self, group_id: GroupId) -> Outcome:
        """Drop an occupied group the algorithm does not need (dynamic sampling: rewards
        that are all equal teach nothing), §4.3 / Figure 8c. Occupied groups of later
        buffers move forward into the hole, so the trainer's buffer stays Ready without
        waiting for new trajectories; the freed entry takes a new Reserve. Counted in
        ``filtered_groups``, not ``aborted_groups``; ``kept`` lists its trajectories."""
        with self._cond:
            group = self._groups.get(group_id)
            if group is None or group.buffer is None:
                raise NotOccupied(
                    f"group {group_id} is not occupied: only a completed group can be "
                    "filtered (abort a reserved one instead)"
                )
            outcome = self._filter(group_id, group)
        self._notify_if_ready(outcome.ready)
        return outcome

    def _filter(self, group_id: GroupId, group: TrackedGroup) -> Outcome:
        kept = tuple(group.completed)
        self._unpin(group_id, group)
        self._close_filtered(group_id)
        return Outcome(kept=kept, ready=self._counts.head_ready(), filtered=True)

    @staticmethod
    def _ask(keep: Callable[[Sequence[TrajId]], bool], group: TrackedGroup) -> bool:
        try:
            return keep(tuple(group.completed))
        except BaseException:
            group.completed.pop()  # the completion is undone: nothing changed
            raise

    def _would_fit(self, group: TrackedGroup, new_v: int) -> bool:
        """Would the reserved ``group`` find an occupied slot with version ``new_v``?"""
        trial = self._counts.copy()
        trial.add_reserved(group.version, -1)
        return trial.repack(extra_at=trial.deadline(new_v)) is not None

    def _close_filtered(self, group_id: GroupId) -> None:
        """A group left its entry (already taken out of the rings) as filtered: occupied
        groups of later buffers move forward into the hole (Figure 8c)."""
        del self._groups[group_id]
        self._close(group_id)
        self.filtered_groups += 1
        self.filtered_this_step += 1
        self._apply_layout(self._repacked())

    def abort_trajectory(self, group_id: GroupId, traj_id: TrajId) -> Outcome:
        """Drop one running member (e.g. its engine failed). The group survives while it can
        still reach ``G`` completed members; otherwise the whole group is aborted."""
        with self._cond:
            group = self._groups.get(group_id)
            if group is None:
                if group_id in self._closed:
                    return self._discarded(())
                raise UnknownGroup(f"group {group_id} is not tracked (never reserved here)")
            self._check_running(group_id, group, traj_id)
            if self.group_capacity - group.dropped - 1 < self.group_size or len(group.members) == 1:
                members = tuple(group.members)
                self._untrack(group_id, group)
                self._apply_layout(self._repacked())
                outcome = Outcome(
                    abort_trajectories=members,
                    abort_groups=(group_id,),
                    ready=self._counts.head_ready(),
                )
            else:
                del group.members[traj_id]
                group.dropped += 1
                if self._rereserve(group_id, group):
                    self._apply_layout(self._repacked())
                outcome = Outcome(abort_trajectories=(traj_id,), ready=self._counts.head_ready())
        self._notify_if_ready(outcome.ready)
        return outcome

    def unreserve(self, group_id: GroupId, traj_id: TrajId) -> None:
        """Undo the Reserve of an initial trajectory that never reached an instance (its
        Route died with the instance before the trajectory left the TS), as if it had
        never been made: the trajectory may be Reserved again. Unlike
        :meth:`abort_trajectory`, nothing is dropped; a group left without members is
        forgotten, not closed."""
        with self._cond:
            group = self._groups.get(group_id)
            self._check_running(group_id, group, traj_id)
            assert group is not None
            del group.members[traj_id]
            if not group.members:
                self._remove_reserved(group_id, group.version)
                del self._groups[group_id]
            else:
                self._rereserve(group_id, group)
            self._apply_layout(self._repacked())
            ready = self._counts.head_ready()
        self._notify_if_ready(ready)

    # -- Consume ----------------------------------------------------------------------

    def consume(self) -> ConsumedBatch:
        """Take the Ready buffer ``version`` and advance the trainer to ``version + 1``.

        Reserved groups that cannot fit in the remaining buffers (only possible with batch
        redundancy) are aborted and listed in ``aborted_groups``.
        """
        with self._cond:
            counts = self._counts
            if not counts.head_ready():
                raise NotReady(explain.not_ready(self._counts, self.batch_size))
            buffer_version = counts.version
            picked = []
            for gid in list(self._pinned[buffer_version % self._n]):
                group = self._groups[gid]
                self._unpin(gid, group)
                del self._groups[gid]
                self._close(gid)
                picked.append(ConsumedGroup(gid, group.version, tuple(group.completed)))
            aborted = self._abort_expired(buffer_version)
            counts.advance()
            self._apply_layout(self._repacked())
            self.consumed_batches += 1
            self.filtered_this_step = 0
            batch = ConsumedBatch(buffer_version, tuple(picked), aborted)
            self.history.append((buffer_version, batch.staleness))
            ready = counts.head_ready()
        self._notify_if_ready(ready)
        return batch

    def _abort_expired(self, buffer_version: int) -> tuple[GroupId, ...]:
        """Reserved groups that no longer fit once buffer ``buffer_version`` is gone."""
        aborted: list[GroupId] = []
        n = self._n

        def drop_oldest(v: int) -> None:
            gid = next(iter(self._reserved[v % n]))
            self._remove_reserved(gid, v)
            self._forget(gid)
            aborted.append(gid)

        expired = buffer_version - self.eta
        while self._reserved[expired % n]:
            drop_oldest(expired)
        # With redundancy the remaining buffers may still be over-full: drop the oldest
        # reservations (the long tail) until the next window fits.
        shifted = self._counts.copy()
        shifted.advance()
        while min(shifted.slack()) < 0:
            v = next(v for v in range(expired + 1, buffer_version + 1) if self._reserved[v % n])
            drop_oldest(v)
            shifted.add_reserved(v, -1)
        return tuple(aborted)

    def _notify_if_ready(self, ready: bool) -> None:
        if not ready:
            return
        with self._cond:
            self._cond.notify_all()
            listeners = list(self._ready_listeners)
            version = self._counts.version
        for callback in listeners:
            try:
                callback(version)
            except Exception:  # a broken listener must not break the protocol
                logger.exception("ready listener %r failed", callback)

    # -- introspection and checkpointing -----------------------------------------------

    def view(self) -> ManagerView:
        """Buffers with their states and entries (occupied as committed, reserved latest)."""
        with self._cond:
            n, v, eta = self._n, self.version, self.eta
            reserved = [
                [(gid, v - eta + k) for gid in self._reserved[(v - eta + k) % n]] for k in range(n)
            ]
            pinned = [
                [(gid, self._groups[gid].version) for gid in self._pinned[(v + j) % n]]
                for j in range(n)
            ]
            return ManagerView(
                eta=eta,
                batch_size=self.batch_size,
                group_size=self.group_size,
                version=v,
                buffers=canonical_buffers(v, self.batch_size, self.capacity, reserved, pinned),
                reserved_groups=sum(len(b) for b in reserved),
                occupied_groups=sum(len(b) for b in pinned),
                consumed_batches=self.consumed_batches,
                aborted_groups=self.aborted_groups,
                filtered_groups=self.filtered_groups,
            )

    def export_state(self) -> dict[str, Any]:
        """Everything needed to resume, as plain data (msgpack/JSON friendly).

        Groups are listed ring by ring in arrival order (reserved ones by version, then
        occupied ones by buffer): that order decides which reservation expires first and
        which occupied group moves first, so the restored manager behaves identically.
        """
        with self._cond:
            n, v, eta = self._n, self.version, self.eta
            order = [gid for k in range(n) for gid in self._reserved[(v - eta + k) % n]]
            order += [gid for j in range(n) for gid in self._pinned[(v + j) % n]]
            groups = [
                {
                    "id": gid,
                    "version": g.version,
                    "buffer": g.buffer,
                    "members": [[t, tv] for t, tv in g.members.items()],
                    "completed": list(g.completed),
                    "dropped": g.dropped,
                }
                for gid, g in ((gid, self._groups[gid]) for gid in order)
            ]
            return checkpoint.export_state(
                checkpoint.SavedState(
                    self.config,
                    v,
                    groups,
                    list(self._closed),
                    self.consumed_batches,
                    self.aborted_groups,
                    [(bv, tuple(st)) for bv, st in self.history],
                    self.filtered_groups,
                    self.filtered_this_step,
                )
            )

    @classmethod
    def restore(cls, state: dict[str, Any]) -> StalenessManager:
        """Rebuild a manager from ``export_state()``, validating it before trusting it."""
        parsed = checkpoint.parse_state(state)
        manager = cls(parsed.config, version=parsed.version)
        manager.consumed_batches = parsed.consumed_batches
        manager.aborted_groups = parsed.aborted_groups
        manager.filtered_groups = parsed.filtered_groups
        manager.filtered_this_step = parsed.filtered_this_step
        manager._closed = dict.fromkeys(parsed.aborted[-REMEMBER_CLOSED:])
        manager.history.extend(parsed.history)
        for raw in parsed.groups:
            group = TrackedGroup(raw["version"])
            group.members = {t: v for t, v in raw["members"]}
            group.completed = list(raw["completed"])
            group.dropped = raw["dropped"]
            manager._groups[raw["id"]] = group
            if raw["buffer"] is None:
                manager._add_reserved(raw["id"], group.version)
            else:
                manager._pin(raw["id"], group, raw["buffer"])
        checkpoint.check_fits(manager._counts)
        return manager
