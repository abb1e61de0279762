"""An optional per-instance timeline of a simulated run (Figure 17).

Attach a :class:`Timeline` to a :class:`~staleflow.sim.cluster.SimCluster` before ``run``;
it is called once per coordinator cycle, after that cycle's commands took effect, and
records every instance's load. Sync (Pull) events are found by comparing instance versions
from one cycle to the next, so they are exact to the cycle even when load is sampled less
often (``every_s``): the coordinator issues every Pull at a cycle's start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.sim.cluster import SimCluster


@dataclass(frozen=True, slots=True)
class LoadSample:
    time: float
    inst: int
    running: int  # trajectories in the decode batch
    waiting: int  # routed here but not admitted (KV full)
    kv_tokens: int
    version: int
    tokens_per_s: float  # decoded since this instance's previous sample, per second


@dataclass(frozen=True, slots=True)
class SyncEvent:
    time: float
    inst: int
    version: int  # the version Pulled


@dataclass(slots=True)
class Timeline:
    every_s: float = 0.0  # 0: sample load at every cycle
    samples: list[LoadSample] = field(default_factory=list)
    syncs: list[SyncEvent] = field(default_factory=list)
    _last: dict[int, tuple[float, int]] = field(default_factory=dict)  # inst: (time, tokens)
    _versions: dict[int, int] = field(default_factory=dict)
    _next: float = 0.0

    def attach(self, cluster: SimCluster) -> Timeline:
        cluster.observers.append(self.observe)
        return self

    def observe(self, cluster: SimCluster) -> None:
        now = cluster.now
        for i, inst in cluster.instances.items():
            if inst.version != self._versions.get(i, 0):
                self.syncs.append(SyncEvent(now, i, inst.version))
            self._versions[i] = inst.version
        if now + 1e-9 < self._next:
            return
        self._next = now + self.every_s
        for i, inst in cluster.instances.items():
            t0, tok0 = self._last.get(i, (now, inst.times.tokens))
            rate = (inst.times.tokens - tok0) / (now - t0) if now > t0 else 0.0
            self._last[i] = (now, inst.times.tokens)
            self.samples.append(
                LoadSample(
                    now, i, len(inst.running), len(inst.waiting), int(inst.kv), inst.version, rate
                )
            )

    def sample_rows(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples]

    def sync_rows(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.syncs]
