"""RolloutPipe's streamed training (``trainer.stream``) in the runtime wired in one process
(``test_runtime_inprocess.wire``): the training loop trains each occupied group of its
buffer before the buffer is Ready, and the bound, conservation and stop still hold."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import pytest

from staleflow.runtime.interface import StopRequested
from staleflow.runtime.workers.audit_trail import AuditedBatches, read_audit
from staleflow.runtime.workers.training_loop import TrainingLoop
from staleflow.trainers.interface import BatchSource
from tests.staleflow.runtime.fakes import CountingTrainer, SyncPusher
from tests.staleflow.runtime.test_runtime_inprocess import Wired, _assert_conserved, run, wire
from trajectory_server import TrajectoryServer
from trajectory_server.types import TrainingBatch

Select = Mapping[int, Sequence[int]]


class StreamingTrainer(CountingTrainer):
    """Records the parts it was streamed and the rest ``train_step`` got, per step."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.wake = wake
        self.parts: list[list[TrainingBatch]] = [[]]
        self.streamed_now = threading.Event()  # a part of the current step came in
        self.dropped = 0
        self.handed: Handed | None = None

    def stream(self, part: TrainingBatch) -> None:
        assert part.groups and not part.dropped
        self.parts[-1].append(part)
        self.streamed_now.set()
        self.wake()

    def drop_stream(self) -> None:
        self.dropped += 1
        self.parts[-1] = []

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self.streamed_now.clear()
        self.parts.append([])
        self.batches.append(batch)  # the rest: possibly no group at all
        self.version += 1
        return {}


class Handed:
    """The TS as the training loop sees it, counting the groups each call hands over
    with their payloads."""

    def __init__(self, ts: TrajectoryServer) -> None:
        self.ts, self.groups = ts, Counter[int]()

    def read_batch(self, group_ids: Iterable[int], select: Select | None = None) -> TrainingBatch:
        return self._count(self.ts.read_batch(group_ids, select))

    def take_batch(
        self, group_ids: Iterable[int], select: Select | None = None, read: Iterable[int] = ()
    ) -> TrainingBatch:
        return self._count(self.ts.take_batch(group_ids, select, read))

    def _count(self, batch: TrainingBatch) -> TrainingBatch:
        self.groups.update(g.group_id for g in batch.groups)
        return batch


def _wake(w: Wired) -> None:
    """Held trajectories leave an instance's generation thread asleep: after the hold
    changed, wake it (as a submit would)."""
    for h in w.hosts.values():
        with h.instance._lock:
            h.instance._work.notify_all()


def _streaming(w: Wired, audit: Path | None = None) -> StreamingTrainer:
    trainer = StreamingTrainer(lambda: _wake(w))
    trainer.handed = Handed(w.ts)
    w.trainer = trainer
    source: BatchSource = trainer.handed
    if audit is not None:
        source = AuditedBatches(source, audit, lambda: trainer.version)
    w.loop = TrainingLoop(
        trainer,
        control=w.control,
        ts=source,
        pusher=SyncPusher(w.ps),
        consume_timeout_s=30,
        stream=True,
    )
    return trainer


def test_groups_are_trained_before_their_buffer_is_ready_and_the_step_gets_the_rest(tmp_path):
    """eta=0, two groups of two per step: the TS holds exactly one step's groups, so step
    ``k`` has trajectories ``4k..4k+3`` and the second group holds ``4k+3``. That one is
    held until the trainer streamed a group of the same step: the buffer can only turn
    Ready if streaming works (else the Consume times out)."""
    box: list[StreamingTrainer] = []
    w = wire(0, hold=lambda tid: tid % 4 == 3 and not box[0].streamed_now.is_set())
    trainer = _streaming(w, audit=tmp_path / "audit.jsonl")
    box.append(trainer)
    reports = run(w, steps=4)
    w.control.check()
    assert [r.version for r in reports] == [0, 1, 2, 3]
    seen: Counter[int] = Counter()
    for r, parts, rest in zip(reports, trainer.parts, trainer.batches, strict=False):
        streamed = [g for p in parts for g in p.groups]
        assert r.streamed_groups == len(streamed) >= 1
        ids = {g.group_id for g in streamed}
        assert ids.isdisjoint(g.group_id for g in rest.groups)
        groups = streamed + list(rest.groups)
        assert len(groups) == 2 and all(len(g.trajectories) == 2 for g in groups)
        for g in groups:
            for t in g.trajectories:
                seen[t.traj_id] += 1
                assert (t.versions == r.version).all()  # exactly on-policy
        assert sorted(r.consumed_traj_ids) == sorted(
            t.traj_id for g in groups for t in g.trajectories
        )
    assert max(seen.values()) == 1 and len(seen) == 16
    # each group's payload crossed from the TS once: the Consume did not send the streamed
    # ones again, and the step's digest (consumed_traj_ids above) still has all of them
    assert trainer.handed is not None
    assert len(trainer.handed.groups) == 8 and set(trainer.handed.groups.values()) == {1}
    # the audit trail still writes every trajectory once, streamed or not, when taken
    lines = read_audit(tmp_path / "audit.jsonl")
    assert sorted(line["traj_id"] for line in lines) == list(range(16))
    assert all(len(line["tokens"]) == len(line["versions"]) > 0 for line in lines)
    assert [line["version"] for line in lines] == [v for v in range(4) for _ in range(4)]
    _assert_conserved(w)
    assert [rec.streamed_groups for rec in w.control.records()] == [
        r.streamed_groups for r in reports
    ]


@pytest.mark.parametrize(
    ("eta", "redundancy"), [(1, 0.0), (3, 0.0), (1, 0.5)], ids=["eta1", "eta3", "redundant"]
)
def test_streaming_keeps_the_bound_and_loses_nothing(eta, redundancy):
    """With redundancy, surplus groups and members are dropped around the streamed ones:
    a streamed group is trained with exactly the members it was occupied with."""
    w = wire(eta, instances=3, batch=3, batch_redundancy=redundancy, group_redundancy=redundancy)
    trainer = _streaming(w)
    reports = run(w, steps=6)
    w.control.check()
    seen: Counter[int] = Counter()
    for r, parts, rest in zip(reports, trainer.parts, trainer.batches, strict=False):
        groups = [g for p in parts for g in p.groups] + list(rest.groups)
        assert len(groups) == 3 and all(len(g.trajectories) == 2 for g in groups)
        for g in groups:
            for t in g.trajectories:
                seen[t.traj_id] += 1
                assert r.version - t.v_traj <= eta
        assert max(r.staleness) <= eta
    assert max(seen.values()) == 1
    _assert_conserved(w)


def test_a_stop_while_streaming_drops_the_parts_and_keeps_the_groups():
    """Nothing streamed is lost: the stop refuses the next Consume, the trainer forgets its
    parts, and their groups stay occupied in the manager and whole in the TS."""
    box: list[StreamingTrainer] = []
    w = wire(0, hold=lambda tid: tid % 4 == 3)  # step 0's buffer never turns Ready
    trainer = _streaming(w)
    box.append(trainer)
    for h in w.hosts.values():
        h.start()
    w.control.start()
    try:
        done = threading.Thread(target=lambda: box.append(w.loop.run(3)))  # type: ignore[arg-type]
        done.start()
        assert trainer.streamed_now.wait(30)  # group A of step 0 was streamed
        w.control.request_stop()
        done.join(30)
        assert not done.is_alive()
    finally:
        w.control.stop()
        for h in w.hosts.values():
            h.stop()
    assert box[1] == []  # no step was taken
    assert trainer.dropped == 1 and trainer.batches == []
    occupied = w.control.manager.trainer_groups()
    assert len(occupied) == 1
    (group,) = occupied
    assert w.ts.group_status(group.group_id).completed == len(group.trajectories) == 2


def test_a_trainer_that_cannot_stream_is_refused_with_the_fix():
    w = wire(0)
    with pytest.raises(ValueError, match=r"trainer\.stream=false"):
        TrainingLoop(
            CountingTrainer(), control=w.control, ts=w.ts, pusher=SyncPusher(w.ps), stream=True
        )


def test_stop_requested_is_what_a_streaming_wait_raises_once_the_run_stops():
    w = wire(0)
    w.control.start()
    try:
        w.control.request_stop()
        with pytest.raises(StopRequested):
            for _ in range(100):  # the stop is handled on the plane's thread
                w.control.trainer_groups(0, 0, 0.05)
    finally:
        w.control.stop()
