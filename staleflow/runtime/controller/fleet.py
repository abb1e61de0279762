"""What the control plane does, on its own thread, when rollout instances leave or join
and when a reward worker's reports may be lost (``docs/recovery.md``).

- **A lost instance** leaves the coordinator's fleet; the TS requeues what was routed to
  it with the longest response it knows, its ``V_traj`` and its reservation
  (``instance_lost``, which also fences the holder id); the Reserves made for a Route
  that died with it before it reached the TS are given back. The supervisor
  (``staleflow.runtime.driver.supervisor``) learns of it from :meth:`FleetOps.take_lost`.
- **A removed instance** (elastic rollout) is interrupted first, so its partial
  responses come back whole, then leaves the same way.
- **A joining instance** (restarted or added) enters empty at the version it Pulled.
- **Completions whose report was lost** (a reward worker died after storing them in the
  TS) are read from the TS's ledger and applied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from staleflow.control import ControlLoop
from staleflow.control.loop import TrajectoryStore
from staleflow.recovery.events import RecoveryEvent, RecoveryLog
from staleflow.runtime.controller.instances import Members
from staleflow.runtime.controller.planes import RuntimePlanes
from staleflow.runtime.interface import InstanceHandle
from trajectory_server.types import InstanceId, LiveTrajectory, TrajState

logger = logging.getLogger(__name__)


class RecoverableStore(TrajectoryStore, Protocol):
    """The TS calls recovery needs beyond the control loop's own."""

    def instance_lost(self, instance_id: InstanceId) -> tuple[int, ...]: ...

    def ledger(self) -> Sequence[LiveTrajectory]: ...


class _Completed(NamedTuple):
    """A completion the TS holds, as the control loop's ``replay`` takes it."""

    traj_id: int
    group_id: int
    response_len: int
    reward: float | None  # None: its reward function failed (dynamic sampling skips it)
    error: str = ""


@dataclass(frozen=True, slots=True)
class LostInstance:
    """An instance the control plane gave up on, for the supervisor to restart."""

    inst: int
    holder: InstanceId
    reason: str


class FleetOps:
    def __init__(
        self,
        members: Members,
        loop: ControlLoop,
        planes: RuntimePlanes,
        ts: RecoverableStore,
        log: RecoveryLog,
        event: Callable[[str, str, str], RecoveryEvent],
    ) -> None:
        self.members, self._loop, self._planes, self._ts = members, loop, planes, ts
        self._log, self._event = log, event
        self._lost: list[LostInstance] = []
        self._lost_lock = threading.Lock()

    def take_lost(self) -> list[LostInstance]:
        """The instances given up on since the last call (any thread: the supervisor asks
        while this thread may be busy, e.g. waiting for a restarted PS)."""
        with self._lost_lock:
            out, self._lost = self._lost, []
        return out

    # -- leaving -------------------------------------------------------------------------

    def lost(self, inst: int, reason: str, reserved: Sequence[int] = ()) -> None:
        """``inst`` is gone (``reserved``: initial trajectories of a Route to it that may
        not have reached the TS)."""
        holder = self.members.remove(inst)
        if holder is not None:
            self._loop.remove_instance(inst)
            requeued = self._ts.instance_lost(holder)
            kept = self._tokens_kept(requeued)
            logger.warning(
                "instance %d lost (%s): %d trajectories back in the TS with %d tokens kept",
                inst,
                reason,
                len(requeued),
                kept,
            )
            self._log.add(
                self._event("instance_lost", f"instance/{inst}", reason),
                requeued=len(requeued),
                tokens_kept=kept,
            )
            with self._lost_lock:
                self._lost.append(LostInstance(inst, holder, reason))
        if reserved:
            self._release(reserved)

    def remove(self, inst: int) -> int:
        """Take ``inst`` out of the run (elastic rollout): interrupt what it holds (its
        partial responses come back whole), then leave as a lost one does. Returns the
        trajectories it gave back."""
        if inst not in self.members:
            raise KeyError(f"instance {inst} is not in the run")
        returned = self._interrupt(inst)
        holder = self.members.remove(inst)
        assert holder is not None
        self._loop.remove_instance(inst)
        left = self._ts.instance_lost(holder)  # anything the interrupt missed
        self._log.add(
            self._event("instance_removed", f"instance/{inst}", "elastic rollout"),
            requeued=len(returned) + len(left),
        )
        return len(returned) + len(left)

    def interrupt_all(self) -> int:
        """Stop every trajectory on every instance and return it to the TS whole (a
        graceful stop); returns how many came back."""
        return sum(len(self._interrupt(inst)) for inst in list(self.members))

    def _interrupt(self, inst: int) -> list[int]:
        try:
            snap = self.members[inst].snapshot()
        except Exception as exc:  # gone already: the TS takes its trajectories back
            self.lost(inst, f"snapshot failed while interrupting: {exc}")
            return []
        ids = [t.traj_id for t in (*snap.run_trajs, *snap.wait_trajs)]
        if not ids:
            return []
        return list(self._planes.interrupt(inst, ids))

    def _release(self, reserved: Sequence[int]) -> None:
        """Reserves of initial trajectories that are still initial in the TS (the Route
        never reached it) or gone: give them back."""
        view = {r.traj_id: r for r in self._ts.routing_view()}
        group_of = self._loop.group_of
        release = []
        for tid in reserved:
            entry = view.get(tid)
            if entry is not None and entry.v_traj is not None:
                continue  # routed before the loss, requeued with its reservation
            gid = entry.group_id if entry is not None else group_of(tid)
            if gid is not None:
                release.append((gid, tid))
        if release:
            self._loop.release_reserves(release)

    def _tokens_kept(self, requeued: Sequence[int]) -> int:
        if not requeued:
            return 0
        ids = set(requeued)
        return sum(r.length - r.prompt_len for r in self._ts.routing_view() if r.traj_id in ids)

    # -- joining -------------------------------------------------------------------------

    def add(
        self, inst: int, handle: InstanceHandle, holder: InstanceId, version: int, kind: str
    ) -> None:
        """``inst`` joins empty at ``version``; ``kind``: instance_restarted or
        instance_added."""
        self.members.add(inst, handle, holder)
        self._loop.add_instance(inst, version)
        self._log.add(self._event(kind, f"instance/{inst}", f"holder {holder}, version {version}"))

    # -- reward reports --------------------------------------------------------------------

    def replay_completions(self) -> int:
        """Apply the completions the TS holds that the manager has not (their reward
        worker died before reporting them); returns how many."""
        completed = [
            _Completed(t.traj_id, t.group_id, t.tokens, t.reward)
            for t in self._ts.ledger()
            if t.state is TrajState.COMPLETED
        ]
        applied = self._loop.replay(completed)
        if applied:
            self._log.add(
                self._event(
                    "completions_replayed", "run", f"{len(applied)} completions without a report"
                ),
                completions_replayed=len(applied),
            )
        return len(applied)
