"""How :class:`MegatronTrainer` (the pool as the training loop drives it) shares a step's
groups over its data-parallel leaders, with rank handles that record their calls in place
of Ray actors (``ray.get`` passes plain values through). The ranks themselves run for real
in ``test_megatron_launch.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray

from staleflow.trainers.interface import BatchDigest
from staleflow.trainers.megatron.pool import MegatronTrainer


class _Call:
    def __init__(self, log: list[tuple[Any, ...]], result: Any = None) -> None:
        self.log, self.result = log, result

    def remote(self, *args: Any) -> Any:
        self.log.append(args)
        return self.result


class _Rank:
    """A rank actor's handle: ``stream`` and ``step`` record what they were given."""

    def __init__(self) -> None:
        self.streamed: list[tuple[Any, ...]] = []
        self.stepped: list[tuple[Any, ...]] = []
        self.stream = _Call(self.streamed)
        self.step = _Call(self.stepped, ({}, BatchDigest()))
        self.drop_stream = _Call([])


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> MegatronTrainer:
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    spec = SimpleNamespace(section=SimpleNamespace(tp=2, dp=2), world=4)
    return MegatronTrainer(spec, [_Rank() for _ in range(4)], version=0)  # type: ignore[arg-type]


def _groups(calls: list[tuple[Any, ...]]) -> set[int]:
    return {gid for call in calls for gid in (call[0] or {})}


def test_a_streamed_group_is_taken_by_the_leader_that_read_it(pool: MegatronTrainer) -> None:
    """That leader holds its payload already (``StreamedGroups``), so the group leaves the
    TS without crossing the wire again; the other groups are shared out as before."""
    ranks: list[_Rank] = pool.ranks  # type: ignore[assignment]
    pool.stream({1: (10, 11), 2: (20, 21), 3: (30, 31), 4: (40, 41)})
    read = [_groups(r.streamed) for r in ranks]
    assert read[1] == read[3] == set()  # TP rank 1 of each replica reads nothing
    assert read[0] and read[2] and read[0] | read[2] == {1, 2, 3, 4}

    select = {g: (10 * g, 10 * g + 1) for g in range(1, 7)}
    step = pool.train_consumed(select, streamed=(1, 2, 3, 4))
    assert pool.version == 1 and isinstance(step.digest, BatchDigest)
    taken = [_groups(r.stepped) for r in ranks]
    assert taken[1] == taken[3] == set()
    assert read[0] <= taken[0] and read[2] <= taken[2]  # each streamed group to its reader
    assert taken[0] | taken[2] == set(select) and not taken[0] & taken[2]
    assert all(call[1] == (1, 2, 3, 4) for r in ranks for call in r.stepped)
    assert len(taken[0] - read[0]) == len(taken[2] - read[2]) == 1  # the rest, evenly

    # the record of who read what lasts one step: a later step shares out as usual
    pool.train_consumed({7: (70,), 8: (80,)}, streamed=(7,))
    assert {7, 8} <= _groups(ranks[0].stepped[-1:]) | _groups(ranks[2].stepped[-1:])
    assert 7 in _groups(ranks[0].stepped[-1:])  # unknown reader: replica 0's leader
