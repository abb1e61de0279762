"""Fastest-of-N over draft methods in the tail race (SpecActor §4.2), at unit level, no
Ray, no threads: the configured race method resolves to a copy's draft method, the race
submits the copy with it down to the engine's request, and the copies that win are
counted by method (and carried across a resume)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from coordinator.race import Race
from coordinator.types import TrajRecord
from staleflow.config.rollout import SpeculationOptions
from staleflow.engines.base import GenerationRequest
from staleflow.rollout.instance import CopyEnd, RolloutInstance
from staleflow.runtime.controller import races as races_mod
from staleflow.runtime.controller.races import RuntimeRaces
from tests.staleflow.runtime.fakes import ScriptedEngine
from trajectory_server.types import RoutedTrajectory


@pytest.mark.parametrize(
    ("method", "race_method", "copy"),
    [
        ("group", "auto", None),  # own never beat group in the benchmark: stay
        ("own", "auto", "group"),
        ("group", "own", "own"),
        ("group", "same", None),
        ("group", "group", None),  # the original's method: the engine's
        ("own", "off", "off"),
        ("off", "auto", None),  # no speculation: a request's method means nothing
    ],
)
def test_the_race_method_resolves_to_a_copy_draft_method(method, race_method, copy) -> None:
    options = SpeculationOptions(method=method, race_method=race_method)
    assert options.race_copy_method() == copy


def test_an_unknown_race_method_is_refused() -> None:
    with pytest.raises(ValueError, match="race_method"):
        SpeculationOptions(method="group", race_method="eagle")


class _Instance:
    """An instance handle that records the copies it is asked to start."""

    def __init__(self, won: bool = False) -> None:
        self.started: list[tuple[int, int, str | None]] = []
        self.won = won

    def prepare_race(self, traj_id: int) -> bool:
        return True

    def race(self, traj_id: int, holder: int, draft_method: str | None = None) -> int | None:
        self.started.append((traj_id, holder, draft_method))
        return 10

    def drop_copies(self, traj_ids: Sequence[int]) -> dict[int, CopyEnd]:
        return {t: CopyEnd(20, self.won) for t in traj_ids if any(s[0] == t for s in self.started)}

    def settle_won(self, traj_ids: Sequence[int]) -> dict[int, int]:
        return {}


class _TS:
    def __init__(self) -> None:
        self.routed: dict[int, tuple[int, ...]] = {}

    def routed_to(self, instance_id: int) -> tuple[int, ...]:
        return self.routed.get(instance_id, ())


def _races(monkeypatch, instances, ts, copy_method, chosen, totals=None) -> RuntimeRaces:
    monkeypatch.setattr(races_mod, "select_races", lambda *a, **k: list(chosen))
    return RuntimeRaces(
        rule=None,  # type: ignore[arg-type]  # select_races is replaced
        ts=ts,
        instances=lambda: instances,
        holders=lambda: {i: 100 + i for i in instances},
        snapshots=lambda: (),
        routable=lambda: (),
        totals=totals,
        copy_method=copy_method,
    )


def test_a_copy_is_started_with_the_race_method_and_its_wins_counted_by_method(
    monkeypatch,
) -> None:
    instances = {0: _Instance(), 1: _Instance(won=True), 2: _Instance()}
    ts = _TS()
    ts.routed[100] = (7, 8)
    traj = TrajRecord(7, 0, 1, 40, 8)
    other = TrajRecord(8, 0, 1, 40, 8)
    races = _races(monkeypatch, instances, ts, "own", [Race(traj, 0, 1), Race(other, 0, 2)])
    assert races.after_cycle(()) == 2
    assert instances[1].started == [(7, 100, "own")]
    assert instances[2].started == [(8, 100, "own")]
    ts.routed[100] = ()  # both completed: the copy on 1 won, the one on 2 lost
    races.settle()
    assert races.won_by_method() == {"own": 1}
    totals = races.totals()
    assert totals["race/won"] == 1 and totals["race/won_own"] == 1
    # a resumed run goes on from its last record's counts
    resumed = _races(monkeypatch, instances, ts, None, [], totals=totals)
    assert resumed.won_by_method() == {"own": 1}
    assert resumed.totals()["race/won_own"] == 1


def test_the_copy_reaches_the_engine_with_its_draft_method() -> None:
    class Recording(ScriptedEngine):
        def __init__(self) -> None:
            super().__init__(target=8)
            self.requests: list[GenerationRequest] = []

        def submit(self, requests: Sequence[GenerationRequest]) -> None:
            self.requests.extend(requests)
            super().submit(requests)

    engine = Recording()
    inst = RolloutInstance(
        3, engine, max_response=16, on_finished=lambda done: None, on_copy_finished=lambda x: ()
    )
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    routed = RoutedTrajectory(
        7, 2, 1, 0, "", np.arange(4, dtype=np.int32), empty_i, empty_f, empty_i
    )
    inst.submit_copy(routed, holder=100, draft_method="own")
    assert [(r.traj_id, r.group_id, r.draft_method) for r in engine.requests] == [(7, 2, "own")]
    assert inst.copies() == {7: 100}
