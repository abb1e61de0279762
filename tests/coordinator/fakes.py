"""Fakes at the coordinator's outer boundaries: the rollout engines, the trajectory server
and the parameter server (the data planes and the snapshot / TS / PS sources).

Everything under test stays real: the coordinator, its strategies, the in-process
executor and the staleness manager (``staleness.StalenessManager``). The fake world keeps
every trajectory in exactly one place (the TS, one instance's running or queued list,
one instance's completed list, or "rewarded" once a Pull clears that list) so that tests
can check conservation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from coordinator import InstanceSnapshot, Snapshot, TrajRecord
from staleness.types import TrajId


@dataclass(slots=True)
class FakeInstance:
    version: int
    kv_budget: int
    running: dict[TrajId, TrajRecord] = field(default_factory=dict)
    waiting: list[TrajRecord] = field(default_factory=list)
    completed: list[TrajId] = field(default_factory=list)

    @property
    def kv(self) -> int:
        return sum(t.length for t in self.running.values())


class FakeCluster:
    """Engines + TS + PS in one object; payloads are :class:`TrajRecord` values."""

    def __init__(
        self, versions: Mapping[int, int], ps_version: int | None = None, kv_budget: int = 10_000
    ) -> None:
        self.instances = {i: FakeInstance(v, kv_budget) for i, v in versions.items()}
        self.ps_version = max(versions.values(), default=0) if ps_version is None else ps_version
        self.ts: dict[TrajId, TrajRecord] = {}
        self.rewarded: set[TrajId] = set()  # completed, and dropped from completed by a Pull
        self.submitted: list[tuple[int, tuple[TrajId, ...]]] = []
        self.pulls: list[tuple[int, int]] = []

    # -- setup and time passing -------------------------------------------------------------

    def enqueue(self, trajs: Iterable[TrajRecord]) -> None:
        for t in trajs:
            self.ts[t.traj_id] = t

    def place(self, inst: int, trajs: Iterable[TrajRecord], *, waiting: bool = False) -> None:
        """Put trajectories on an instance directly (as if routed long ago)."""
        for t in trajs:
            if waiting:
                self.instances[inst].waiting.append(t)
            else:
                self.instances[inst].running[t.traj_id] = t

    def generate(self, tokens: int = 1) -> None:
        for inst in self.instances.values():
            for tid, t in list(inst.running.items()):
                inst.running[tid] = dataclasses.replace(t, length=t.length + tokens)

    def finish(self, traj_id: TrajId) -> None:
        for inst in self.instances.values():
            if traj_id in inst.running:
                del inst.running[traj_id]
                inst.completed.append(traj_id)
                return
        raise KeyError(traj_id)

    def where(self, traj_id: TrajId) -> list[str]:
        """Every place the trajectory is found (a healthy world has exactly one)."""
        out = ["ts"] if traj_id in self.ts else []
        if traj_id in self.rewarded:
            out.append("rewarded")
        for i, inst in self.instances.items():
            if traj_id in inst.running:
                out.append(f"run:{i}")
            if any(t.traj_id == traj_id for t in inst.waiting):
                out.append(f"wait:{i}")
            if traj_id in inst.completed:
                out.append(f"done:{i}")
        return out

    # -- sources the coordinator reads ------------------------------------------------------

    def snapshot(self) -> Snapshot:
        return Snapshot(
            tuple(
                InstanceSnapshot(
                    inst=i,
                    kv_cache=inst.kv,
                    run_trajs=tuple(inst.running.values()),
                    wait_trajs=tuple(inst.waiting),
                    complete_trajs=tuple(inst.completed),
                    inst_version=inst.version,
                )
                for i, inst in sorted(self.instances.items())
            )
        )

    def routable(self) -> Sequence[TrajRecord]:
        return list(self.ts.values())

    def latest_version(self) -> int:
        return self.ps_version

    # -- EnginePlane ----------------------------------------------------------------------

    def interrupt(self, inst: int, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        return self._remove(inst, trajs)

    def abort(self, inst: int, trajs: Sequence[TrajId]) -> Collection[TrajId]:
        return list(self._remove(inst, trajs))

    def submit(
        self, inst: int, payloads: Mapping[TrajId, object], v_traj: Mapping[TrajId, int]
    ) -> list[TrajId]:
        target = self.instances[inst]
        for tid, payload in payloads.items():
            assert isinstance(payload, TrajRecord)
            t = payload if tid not in v_traj else dataclasses.replace(payload, v_traj=v_traj[tid])
            assert t.v_traj is not None and t.v_traj <= target.version, (t, target.version)
            if not target.waiting and target.kv + t.length <= target.kv_budget:
                target.running[tid] = t
            else:
                target.waiting.append(t)
        self.submitted.append((inst, tuple(payloads)))
        return []

    def _remove(self, inst: int, trajs: Sequence[TrajId]) -> dict[TrajId, object]:
        target = self.instances[inst]
        wanted = set(trajs)
        out: dict[TrajId, object] = {}
        for tid in trajs:
            if tid in target.running:
                out[tid] = target.running.pop(tid)
        kept = []
        for t in target.waiting:
            if t.traj_id in wanted:
                out[t.traj_id] = t
            else:
                kept.append(t)
        target.waiting = kept
        return out

    # -- TrajectoryPlane --------------------------------------------------------------------

    def take(self, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        return {t: self.ts.pop(t) for t in trajs if t in self.ts}

    def give_back(self, partials: Mapping[TrajId, object]) -> None:
        for tid, payload in partials.items():
            assert isinstance(payload, TrajRecord)
            self.ts[tid] = payload

    # -- ParameterPlane ---------------------------------------------------------------------

    def pull(self, inst: int, at_least: int) -> int:
        assert self.ps_version >= at_least
        target = self.instances[inst]
        assert not target.running and not target.waiting, "Pull before its Interrupt"
        target.version = self.ps_version
        self.rewarded.update(target.completed)
        target.completed = []
        self.pulls.append((inst, self.ps_version))
        return self.ps_version


def group(
    group_id: int, size: int, *, first_traj: int, length: int = 100, v_traj: int | None = None
) -> list[TrajRecord]:
    """``size`` trajectories of one group (initial unless ``v_traj`` is given)."""
    return [
        TrajRecord(first_traj + k, group_id, v_traj, length, min(length, 50)) for k in range(size)
    ]
