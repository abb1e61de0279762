"""What recovered, when: the events of a run's recoveries and their totals.

Every recovery (a lost instance and its restart, a lost reward worker, a restarted PS, an
instance added or removed, a checkpoint, a resume) is one :class:`RecoveryEvent` for the
dashboard, and adds to the ``recovery/*`` totals that every step record carries. Pure
Python; the control plane keeps the log, the launcher adds what it did.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "recovery/"

# kind -> what happened (docs/recovery.md lists them)
KINDS: Mapping[str, str] = {
    "instance_lost": "a rollout instance died or failed; its trajectories went back to the TS",
    "instance_restarted": "a lost rollout instance was started again under a new holder id",
    "instance_given_up": "a lost rollout instance ran out of restarts; the run goes on without it",
    "instance_added": "a rollout instance joined the run (elastic rollout)",
    "instance_removed": "a rollout instance left the run (elastic rollout)",
    "scale_refused": "an instance could not be added: no room on the rollout nodes",
    "reward_worker_lost": "a reward worker died; what it was scoring went to another worker",
    "reward_worker_restarted": "a lost reward worker was started again",
    "completions_replayed": "completions stored in the TS whose report was lost were applied",
    "ps_lost": "a parameter-server replica died",
    "ps_restarted": "a parameter-server replica was restarted and refilled by the trainer",
    "checkpoint": "the run's state was written to a checkpoint",
    "resumed": "the run resumed from a checkpoint",
    "stop": "the run was asked to stop and checkpoints before it ends",
}


@dataclass(frozen=True, slots=True)
class RecoveryEvent:
    """One recovery. ``time``: seconds since the run started (its own clock); ``step``:
    training steps done by then; ``subject``: the actor (``instance/3``, ``reward/0``,
    ``ps/0``) or ``run``."""

    time: float
    kind: str
    subject: str
    detail: str = ""
    step: int = 0


class RecoveryLog:
    """The events of a run and the ``recovery/*`` totals (thread-safe). ``totals`` from
    a checkpoint's last record continue a resumed run's counts."""

    def __init__(self, totals: Mapping[str, float] | None = None) -> None:
        self._lock = threading.Lock()
        self._events: list[RecoveryEvent] = []
        self._totals: dict[str, float] = {
            k: float(v) for k, v in (totals or {}).items() if k.startswith(PREFIX)
        }

    def add(self, event: RecoveryEvent, **amounts: float) -> None:
        """Record ``event``; it counts one in ``recovery/<kind>``, and each amount (e.g.
        ``requeued=3``) adds to ``recovery/<name>``."""
        if event.kind not in KINDS:
            raise ValueError(f"unknown recovery event kind {event.kind!r}; one of {sorted(KINDS)}")
        with self._lock:
            self._events.append(event)
            for name, value in ((event.kind, 1.0), *amounts.items()):
                key = PREFIX + name
                self._totals[key] = self._totals.get(key, 0.0) + float(value)

    def since(self, index: int) -> list[RecoveryEvent]:
        with self._lock:
            return self._events[index:]

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
