"""Fakes for the dashboard tests, at one boundary: the run behind ``RunSource``.

``FakeSource`` fakes the *run* (no Ray, no simulator), but what it reports is built by
the real components: buffers come from a real ``StalenessManager`` driven through
Reserve / Occupy, snapshots are real ``InstanceSnapshot`` s, TS counts a real
``TSStats``. ``FakeRay`` fakes the ray module for ``RaySource``: a handle's
``method.remote(...)`` returns the value itself and ``get`` hands it back.
"""

from __future__ import annotations

import math
from typing import Any

from coordinator.cost_model import QWEN3_30B_A3B_H20
from coordinator.types import InstanceSnapshot, TrajRecord
from staleflow.dashboard.interface import (
    ActionNotSupported,
    InstanceDetail,
    LiveView,
    LoadSample,
    Page,
    PSView,
    RunEvent,
    RunInfo,
)
from staleflow.dashboard.timeline import SeqLog
from staleflow.runfolder.step_record import StepRecord, speculation_keys
from staleness import StalenessConfig, StalenessManager
from trajectory_server.types import TSStats

ETA, BATCH, GROUP, INSTANCES = 2, 4, 2, 3


def manager() -> StalenessManager:
    """Buffer 0: 3 groups occupied, 1 reserved (Stuck); buffer 1: 1 reserved."""
    m = StalenessManager(StalenessConfig(eta=ETA, batch_size=BATCH, group_size=GROUP))
    traj = 0
    for gid in range(5):
        for _ in range(GROUP):
            m.reserve(gid, traj, 0)
            traj += 1
    for gid in range(3):
        for t in range(gid * GROUP, (gid + 1) * GROUP):
            m.complete(gid, t)
    return m


def snapshot(inst: int, version: int = 1) -> InstanceSnapshot:
    run = tuple(TrajRecord(10 * inst + k, inst, 0, 100 + k, 20) for k in range(inst + 1))
    wait = (TrajRecord(900 + inst, 7, 1, 30, 20),)
    return InstanceSnapshot(inst, sum(t.length for t in run), run, wait, (5, 6), version)


def ts_stats() -> TSStats:
    return TSStats(
        capacity_groups=12,
        groups=5,
        queued=3,
        routed=6,
        completed=1,
        initial=2,
        queued_by_v={0: 1},
        routed_by_v={0: 4, 1: 2},
        completed_by_v={0: 1},
        created_trajectories=12,
        consumed_trajectories=2,
        aborted_trajectories=0,
        created_groups=6,
        consumed_groups=1,
        aborted_groups=0,
        dataset_exhausted=False,
    )


def flat_record(step: int) -> dict[str, float]:
    """Step ``step`` as a ``metrics.jsonl`` line holds it (written by hand: the format
    earlier runs wrote must keep reading)."""
    rec = {
        "step": float(step),
        "version": float(step - 1),
        "time/elapsed_s": 2.0 * step,
        "throughput/tokens_per_s": 100.0 * step,
        "throughput/step_tokens_per_s": 120.0,
        "trainer/idle_ratio": 0.25,
        "rollout/reward_mean": 0.1 * step,
        "rollout/idle_ratio": 0.1,
        "staleness/hist/0": 3.0,
        "staleness/hist/1": 1.0,
        "staleness/mean": 0.25,
        "train/corrected_frac": 0.125,
        "ps/version": float(step),
        **speculation_keys(verifications=4 * step, drafted=20 * step, accepted=10 * step),
    }
    for i in range(INSTANCES):
        rec[f"rollout/idle_ratio/{i}"] = 0.1 * i
        rec[f"rollout/version/{i}"] = float(step - 1)
    return rec


def record(step: int) -> StepRecord:
    return StepRecord.from_flat(flat_record(step))


class FakeSource:
    def __init__(self, steps: int = 5, *, actions: tuple[str, ...] = ("poke",)) -> None:
        self.manager = manager()
        self.actions = actions
        self.acted: list[str] = []
        self.closed = False
        self._records: SeqLog[StepRecord] = SeqLog()
        self._records.extend(record(s) for s in range(1, steps + 1))
        self._load: SeqLog[LoadSample] = SeqLog()
        self._events: SeqLog[RunEvent] = SeqLog()
        for t in range(10):
            for i in range(INSTANCES):
                self._load.append(LoadSample(float(t), i, 1, i + t % 3, 1, 500, 40.0))
        self._events.extend(
            [RunEvent(3.0, "pull", 1, 0), RunEvent(2.5, "push", 1), RunEvent(2.0, "step", 1)]
        )

    def info(self) -> RunInfo:
        return RunInfo(
            kind="live",
            name="fake-run",
            clock="wall",
            eta=ETA,
            batch_size=BATCH,
            group_size=GROUP,
            instances=INSTANCES,
            cost_model=QWEN3_30B_A3B_H20,
            config={"eta": ETA},
            actions=self.actions,
            notes=("a fake run",),
        )

    def live(self) -> LiveView:
        return LiveView(
            buffers=self.manager.view(),
            instances=tuple(
                InstanceDetail(
                    inst=i,
                    version=1,
                    snapshot=snapshot(i),
                    measured_tokens_per_s=math.nan if i == 2 else 50.0 * i,
                    idle_ratio=0.1 * i,
                    pending_commands=0,
                    last_cycle_commands={"route": i},
                )
                for i in range(INSTANCES)
            ),
            ts=ts_stats(),
            ps_version=2,
            steps=len(self._records),
            elapsed_s=12.5,
            finished=False,
            cycles=40,
            discarded=1,
        )

    def records(self, since: int, limit: int) -> Page[StepRecord]:
        return self._records.page(since, limit)

    def load(self, since: int, limit: int) -> Page[LoadSample]:
        return self._load.page(since, limit)

    def events(self, since: int, limit: int) -> Page[RunEvent]:
        return self._events.page(since, limit)

    def ps(self) -> PSView:
        return PSView(2, (1, 2), 3, (1,), False, 10.0, {0: 3.0}, None, ("sizes unknown",))

    def act(self, action: str) -> str:
        if action == "refuse":
            raise ActionNotSupported("cannot refuse now")
        self.acted.append(action)
        return f"did {action}"

    def close(self) -> None:
        self.closed = True


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeActor:
    """Methods answer from the given functions: ``FakeActor(live=lambda: ...)``."""

    def __init__(self, **methods: Any) -> None:
        for name, fn in methods.items():
            setattr(self, name, _Remote(fn))


class FakeRayActorError(Exception):
    pass


class FakeGetTimeoutError(Exception):
    pass


class FakeRay:
    class exceptions:  # spelled like the module ray.exceptions
        RayActorError = FakeRayActorError
        GetTimeoutError = FakeGetTimeoutError

    @staticmethod
    def get(value: Any, timeout: float | None = None) -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    @staticmethod
    def wait(
        values: list[Any], num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        return list(values), []  # every fake answer is there at once
