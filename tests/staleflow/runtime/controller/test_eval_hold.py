"""The control plane holds every ``eval.every``-th step's record until its held-out
evaluation is in, then publishes it with the scores; one evaluation at a time. Then a
whole evaluation cycle in one process, without Ray: the real control plane, TS and
instance hosts (scripted engines), the driver's round bookkeeping (``EvalRound``) playing
the driver. Training goes on, the bound holds and every trajectory is accounted for,
while the evaluation requests run on the same engines."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from staleflow.data import PromptDataset
from staleflow.rewards.estimators import EvalScores, score_problems
from staleflow.rollout.eval_lane import EVAL_ID_BASE
from staleflow.runfolder.step_record import StepRecord, evaluations
from staleflow.runtime.controller.eval_hold import EvalHold
from staleflow.runtime.driver.eval_rounds import EvalRound
from tests.staleflow.runtime.test_runtime_inprocess import _assert_conserved, wire

SCORES = EvalScores(0.5, 0.75, 2, 4, 10, 3, 4, 1.5)


def _records(n: int) -> list[StepRecord]:
    return [StepRecord(step=i + 1, version=i, elapsed_s=float(i + 1)) for i in range(n)]


def test_the_due_record_and_those_after_it_wait_for_the_scores():
    hold = EvalHold(every=2)
    records: list[StepRecord] = []
    for step in (1, 2, 3):
        hold.before_step(step)
        records += _records(step)[-1:]
    assert hold.held == [2] and hold.published(len(records)) == 1  # steps 2 and 3 wait
    assert hold.due(len(records)) == 2
    assert not hold.done(records, 3, SCORES)  # not the step due: nothing changes
    for step in (4, 5, 6):  # 4 waits its turn; 6, due while 2 runs and 4 waits, replaces 4
        hold.before_step(step)
        records.append(StepRecord(step=step, version=step - 1, elapsed_s=float(step)))
    assert hold.held == [2, 6] and hold.skipped == 1
    assert hold.done(records, 2, SCORES)
    assert hold.published(len(records)) == 5 and hold.due(6) == 6  # 6's turn now
    flat = records[1].to_flat()
    assert flat["eval/mean_at_k"] == 0.5 and flat["eval/pass_at_k"] == 0.75
    assert (flat["eval/k"], flat["eval/samples"], flat["eval/problems"]) == (2, 4, 10)
    assert (flat["eval/version"], flat["eval/version_max"]) == (3, 4)
    assert StepRecord.from_flat(flat) == records[1]  # typed fields: they round-trip
    assert "eval/mean_at_k" not in records[3].to_flat()  # the skipped step has none
    assert hold.done(records, 6, None) and hold.published(6) == 6 and hold.due(6) is None


def test_a_step_whose_evaluation_failed_is_published_without_scores():
    hold = EvalHold(every=1)
    hold.before_step(1)
    records = _records(1)
    assert hold.published(1) == 0 and hold.done(records, 1, None)
    assert hold.published(1) == 1 and records[0].eval_mean_at_k is None


def test_off_holds_nothing():
    hold = EvalHold(every=0)
    for step in range(1, 5):
        hold.before_step(step)
    assert hold.held == [] and hold.published(4) == 4


def test_the_summary_takes_the_last_and_the_best_evaluation():
    hold = EvalHold(every=1)
    records = _records(3)
    for step, mean in ((1, 0.25), (3, 0.5)):
        hold.held = [step]
        hold.done(records, step, EvalScores(mean, mean, 1, 1, 8, step, step, 1.0))
    got = evaluations(records)
    assert got["eval_last"]["step"] == 3 and got["eval_best"]["mean_at_k"] == 0.5
    assert evaluations(_records(2)) == {}


# -- a whole cycle in one process ----------------------------------------------------------


def _play_the_driver(w, heldout, stop: threading.Event, taken: list[EvalRound]) -> None:
    """What ``EvalRounds`` does over Ray, here with the hosts themselves; the reward is
    the parity of the response's length, as ``parity_scorer`` scores the trajectories."""
    first = EVAL_ID_BASE
    while not stop.is_set():
        step = w.control.eval_due()
        if step is None or (taken and taken[-1].step == step):
            time.sleep(0.005)
            continue
        r = EvalRound(step, heldout, samples=2, k=2, instances=sorted(w.hosts), first_id=first)
        first = r.next_id
        for inst, requests in r.requests.items():
            w.hosts[inst].submit_eval(requests)
        while not r.complete:
            for inst in r.waiting_on():
                todo = r.received(w.hosts[inst].take_eval())
                r.scored([t[0] for t in todo], [float(len(t[1]) % 2) for t in todo])
            time.sleep(0.002)
        taken.append(r)
        w.control.eval_done(step, r.scores())


def test_evaluation_rounds_leave_the_bound_and_the_trajectories_alone():
    eta, steps = 1, 6
    w = wire(eta)
    w.control.evals = EvalHold(every=2)
    heldout = PromptDataset("h", [np.array([3, 4, 5], np.int32)] * 3, ["1", "2", "3"])
    stop, taken = threading.Event(), []
    driver = threading.Thread(target=_play_the_driver, args=(w, heldout, stop, taken))
    for h in w.hosts.values():
        h.start()
    w.control.start()
    driver.start()
    try:
        reports = w.loop.run(steps)
        deadline = time.monotonic() + 30
        while len(w.control.records()) < steps:  # the last step's evaluation
            assert time.monotonic() < deadline, "the held records never came out"
            time.sleep(0.01)
    finally:
        stop.set()
        driver.join(10)
        w.control.stop()
        for h in w.hosts.values():
            h.stop()
    w.control.check()
    records = w.control.records()
    # steps 2 and 6 (the last due) are evaluated; 4 too, unless 6 came while 2 still ran
    evaluated = [r.step for r in taken]
    assert evaluated in ([2, 4, 6], [2, 6])
    assert len(evaluated) + w.control.evals.skipped == 3
    assert [r.step for r in records if r.eval_mean_at_k is not None] == evaluated
    for r in taken:
        rec = records[r.step - 1]
        # by hand: every response of problem p runs on instance p % 2, whose scripted
        # engine answers id i with 3 + inst + i % 4 tokens; reward = length parity
        rewards: dict[int, list[float]] = {}
        for p in range(3):
            for j in range(2):
                i = r.next_id - 6 + 2 * p + j
                rewards.setdefault(p, []).append(float((3 + p % 2 + i % 4) % 2))
        mean, passed = score_problems(rewards, 2)
        assert (rec.eval_mean_at_k, rec.eval_pass_at_k) == pytest.approx((mean, passed))
        assert (rec.eval_problems, rec.eval_samples, rec.eval_k) == (3, 2, 2)
        assert 0 <= rec.eval_version <= rec.eval_version_max <= steps
    assert all(max(r.staleness) <= eta for r in reports)
    _assert_conserved(w)  # the TS holds trajectories only: none was an evaluation
    assert w.ts.stats().consumed_trajectories == steps * 2 * 2
    assert all(t < EVAL_ID_BASE for h in w.hosts.values() for t in h.held())
