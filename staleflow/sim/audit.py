"""An independent check of the staleness bound on what the trainer actually received.

The staleness manager records the staleness of every consumed group (``V_buf - V_group``),
but that is the code under test checking itself. This audit looks only at the trainer and
the engines: each trajectory's per-token versions are stamped by the simulated instance
that generated the token (the instance's model version at that moment), and the trainer's
version when it consumes a batch is the number of steps it has finished. For every
consumed trajectory it records

    staleness = trainer version at consumption - version of the trajectory's first token

(issue #17's definition) and, stricter, the same against the *oldest* of its tokens. The
two differ when a trajectory moved to an instance older than the one that began it:
Algorithm 2 allows any instance whose version is at least ``V_traj`` (the version it was
admitted at, which the TS checks every token against), so a later token may be older
than the first but never older than ``V_traj``; ``older_later_tokens`` counts such
trajectories. Nothing here reads the manager, the TS's ``V_traj`` or the coordinator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from staleflow.sim.cluster import SimCluster
    from trajectory_server.types import TrainingBatch


class StalenessAudit:
    """Attach to a cluster before :meth:`SimCluster.run`; read the results after."""

    def __init__(self) -> None:
        self.max_staleness = 0  # against the first token
        self.max_staleness_oldest_token = 0  # against the oldest token
        self.trajectories = 0
        self.batches = 0
        self.older_later_tokens: list[str] = []  # a later token older than the first

    def attach(self, cluster: SimCluster) -> StalenessAudit:
        """Record every batch the trainer takes from the TS. The cluster calls
        ``ts.take_batch`` once per Consume, while the trainer is idle, so the trainer's
        finished steps are the version it is about to train."""
        take = cluster.ts.take_batch
        trainer = cluster.trainer

        def recording(
            group_ids: Iterable[int],
            select: Mapping[int, Sequence[int]] | None = None,
            read: Iterable[int] = (),
        ) -> TrainingBatch:
            taken = take(group_ids, select, read)
            self._record(trainer.steps, taken)
            return taken

        cluster.ts.take_batch = recording  # type: ignore[method-assign]
        return self

    def _record(self, version: int, taken: TrainingBatch) -> None:
        self.batches += 1
        for group in taken.groups:
            for tr in group.trajectories:
                versions = tr.versions
                if len(versions) == 0:
                    continue
                first, oldest = int(versions[0]), int(versions.min())
                if oldest < first:
                    self.older_later_tokens.append(
                        f"trajectory {tr.traj_id}: a token of version {oldest} after a first "
                        f"token of version {first}"
                    )
                self.max_staleness = max(self.max_staleness, version - first)
                self.max_staleness_oldest_token = max(
                    self.max_staleness_oldest_token, version - oldest
                )
                self.trajectories += 1
