"""A toy cluster driving the real staleness manager, to watch the protocol at work.

Rollout instances hold policy versions that lag behind the trainer; each starts a
group whenever the manager admits its version, finishes trajectories of random length,
and pulls new weights now and then. The trainer consumes every Ready buffer after a
training step of fixed duration. Time is virtual (ticks).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from staleness import ManagerView, StalenessConfig, StalenessManager


@dataclass
class DemoResult:
    ticks: int
    batches: int
    staleness: Counter[int] = field(default_factory=Counter)
    final_view: ManagerView | None = None
    rejected_routes: int = 0


def run_demo(
    eta: int = 3,
    batch_size: int = 8,
    group_size: int = 4,
    instances: int = 4,
    slots: int = 8,
    steps: int = 10,
    train_ticks: int = 20,
    seed: int = 0,
    on_tick=None,
) -> DemoResult:
    rng = random.Random(seed)
    m = StalenessManager(StalenessConfig(eta=eta, batch_size=batch_size, group_size=group_size))
    version = [0] * instances
    running: list[list[tuple[int, int, int]]] = [[] for _ in range(instances)]  # (gid, tid, left)
    result = DemoResult(0, 0)
    next_gid = 0
    trainer_busy = 0
    published = 0  # the newest version on the parameter server
    while result.batches < steps:
        result.ticks += 1
        for i in range(instances):
            if published > version[i] and rng.random() < 0.05:
                version[i] = published  # pull; partial trajectories keep their V_traj
            while len(running[i]) + group_size <= slots:
                if not m.verify(version[i]):
                    result.rejected_routes += 1
                    break
                length = rng.choice((3, 5, 8, 40))  # groups are all short or all long
                for t in range(group_size):
                    tid = next_gid * group_size + t
                    m.reserve(next_gid, tid, version[i])
                    running[i].append((next_gid, tid, length + rng.randrange(4)))
                next_gid += 1
            still = []
            for gid, tid, left in running[i]:
                if left <= 1:
                    m.complete(gid, tid)
                else:
                    still.append((gid, tid, left - 1))
            running[i] = still
        if trainer_busy:
            trainer_busy -= 1
            if trainer_busy == 0:
                published = m.version  # the trained weights reach the parameter server
        elif m.is_ready():
            batch = m.consume()
            result.batches += 1
            result.staleness.update(batch.staleness)
            trainer_busy = train_ticks
        if on_tick is not None:
            on_tick(result.ticks, m)
    result.final_view = m.view()
    return result
