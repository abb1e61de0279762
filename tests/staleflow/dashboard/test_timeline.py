"""The append-only log and the recorder that derives load samples and markers."""

from __future__ import annotations

from staleflow.dashboard.timeline import InstanceObservation, Recorder, SeqLog


def test_seqlog_pages_keep_their_indices_when_old_items_are_dropped():
    log: SeqLog[int] = SeqLog(maxlen=5)
    log.extend(range(8))
    page = log.page(0, 10)
    assert (page.first, page.start, page.next, page.total) == (3, 3, 8, 8)
    assert page.items == (3, 4, 5, 6, 7)
    assert log.page(6, 1).items == (6,) and log.page(6, 1).next == 7
    assert log.page(8, 5).items == () and log.page(100, 5).start == 8
    assert log.last() == 7 and len(log) == 8


def _obs(inst: int, version: int, tokens: int | None = None) -> InstanceObservation:
    return InstanceObservation(inst, version, 2, 1, 300, tokens)


def test_recorder_marks_pulls_pushes_and_steps_after_a_baseline():
    rec = Recorder()
    rec.observe(0.0, [_obs(0, 3, 0), _obs(1, 3, 0)], ps_version=3, steps=3)
    assert len(rec.events) == 0  # attaching mid-run is not an event
    rec.observe(1.0, [_obs(0, 3, 100), _obs(1, 3, 50)], ps_version=4, steps=4)
    rec.observe(2.0, [_obs(0, 4, 150), _obs(1, 3, 90)], ps_version=4, steps=4)
    events = rec.events.page(0, 10).items
    assert [(e.time, e.kind, e.version, e.inst) for e in events] == [
        (1.0, "push", 4, None),
        (1.0, "step", 4, None),
        (2.0, "pull", 4, 0),
    ]
    assert rec.last_pull == {0: 2.0} and rec.last_push == 1.0
    assert rec.rates == {0: 50.0, 1: 40.0}
    assert len(rec.load) == 6
    assert rec.load.last().tokens_per_s == 40.0


def test_recorder_samples_load_every_every_s():
    rec = Recorder(every_s=1.0)
    for k in range(10):
        rec.observe(0.25 * k, [_obs(0, 0)], ps_version=None, steps=0)
    assert [s.time for s in rec.load.page(0, 10).items] == [0.0, 1.0, 2.0]
