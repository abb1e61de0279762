"""A small in-process run for the recovery tests: the real staleness manager and trajectory
server, driven by a few lines that play the coordinator, the instances and the reward.

Fakes one edge only: prompts come from a positioned cycle of tiny prompts (like
``PromptSampler``, it can say where it is). Everything under test is the real code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from staleflow.recovery import RunState
from staleness import StalenessConfig, StalenessManager
from trajectory_server import PartialTrajectory, TrajectoryServer, TrajectoryServerConfig


@dataclass(frozen=True)
class Prompt:
    sample_id: int
    prompt_ids: np.ndarray
    answer: str


class Prompts:
    def __init__(self, drawn: int = 0) -> None:
        self.drawn = drawn

    def next_sample(self) -> Prompt:
        i = self.drawn
        self.drawn += 1
        return Prompt(i, np.arange(2 + i % 3, dtype=np.int32) + 10, str(i))

    def state(self) -> dict[str, int]:
        return {"drawn": self.drawn}


def token(traj_id: int, position: int) -> int:
    """The token an instance generates at ``position``: regenerating it gives the same."""
    return (traj_id * 31 + position * 7) % 50 + 3


def response(traj_id: int, start: int, n: int, version: int, prefix=None):
    """The response after ``n`` more tokens at ``version`` (continuing ``prefix``)."""
    tokens = np.array([token(traj_id, p) for p in range(start + n)], dtype=np.int32)
    versions = np.full(start + n, version, dtype=np.int32)
    if prefix is not None:
        versions[:start] = prefix
    return tokens, np.full(start + n, -0.25, dtype=np.float32), versions


@dataclass
class Run:
    protocol: StalenessConfig
    manager: StalenessManager
    ts: TrajectoryServer
    steps: int = 0

    def __post_init__(self) -> None:
        self.group_of: dict[int, int] = {}
        self.held: dict[int, np.ndarray] = {}  # per-token versions an instance holds

    @classmethod
    def start(cls, eta: int = 2, batch: int = 2, group: int = 2, group_red: float = 0.0) -> Run:
        protocol = StalenessConfig(eta, batch, group, group_redundancy=group_red)
        ts_config = TrajectoryServerConfig(eta, batch, group, group_redundancy=group_red)
        return cls(protocol, StalenessManager(protocol), TrajectoryServer(ts_config, Prompts()))

    def route(self, traj_ids, version: int, instance: int | str) -> None:
        """Reserve (initial ones) and route, as the executor does."""
        view = {r.traj_id: r for r in self.ts.routing_view()}
        for tid in traj_ids:
            self.group_of[tid] = view[tid].group_id
            if view[tid].v_traj is None:
                self.manager.reserve(view[tid].group_id, tid, version)
        versions = {t: version if view[t].v_traj is None else view[t].v_traj for t in traj_ids}
        for payload in self.ts.route(list(traj_ids), versions, instance):
            self.held[payload.traj_id] = payload.versions

    def generate(self, traj_id: int, n: int, version: int) -> tuple[np.ndarray, ...]:
        """``n`` more tokens on the instance that holds the trajectory."""
        known = self.held[traj_id]
        out = response(traj_id, len(known), n, version, known)
        self.held[traj_id] = out[2]
        return out

    def progress(self, traj_id: int, n: int, version: int, instance: int | str) -> None:
        partial = PartialTrajectory(traj_id, *self.generate(traj_id, n, version))
        self.ts.report_progress([partial], instance)

    def interrupt(self, traj_id: int, n: int, version: int) -> None:
        self.ts.interrupt_return([PartialTrajectory(traj_id, *self.generate(traj_id, n, version))])

    def finish(self, traj_id: int, n: int, version: int, *, report: bool = True) -> None:
        """The reward path: the TS first, then (if ``report``) the manager's Occupy."""
        self.ts.complete(traj_id, *self.generate(traj_id, n, version), 1.0, "stop")
        if report:
            self.occupy(traj_id)

    def occupy(self, traj_id: int) -> None:
        out = self.manager.complete(self.group_of[traj_id], traj_id)
        for g in out.abort_groups:
            self.ts.abort_group(g)
        self.ts.abort([t for t in out.abort_trajectories if t != traj_id or out.discarded])

    def train(self) -> int:
        batch = self.manager.consume()
        self.ts.take_batch([g.group_id for g in batch.groups])
        for g in batch.aborted_groups:
            self.ts.abort_group(g)
        self.steps += 1
        return batch.version

    def state(self, metrics=()) -> RunState:
        """The consistent cut: the manager first, then the TS."""
        staleness = self.manager.export_state()
        return RunState(
            self.steps, self.manager.version, self.manager.version, staleness,
            self.ts.export_state(), list(metrics),
        )  # fmt: skip


def busy_run() -> Run:
    """A run after one training step with trajectories in every state: routed with and
    without reported progress, a queued partial, completed ones, a consumed batch behind."""
    run = Run.start(eta=2, batch=2, group=2)
    run.route([0, 1, 2, 3], 0, "a")
    for t in (0, 1, 2, 3):
        run.finish(t, 3, 0)
    assert run.train() == 0
    run.route([4, 5, 6], 1, "a")
    run.progress(4, 5, 1, "a")
    run.interrupt(6, 2, 1)
    run.route([7], 0, "b")
    run.finish(7, 4, 1)
    return run
