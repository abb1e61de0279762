"""The driver's evaluation rounds: how problems are dealt to instances, what a lost
instance or reward worker costs, and the scores handed to the control plane, against
hand-worked values. The actors are plain objects behind Ray's calling convention
(``FakeRay``); the rounds' code is the real one."""

from __future__ import annotations

import numpy as np
import pytest

from staleflow.data import PromptDataset
from staleflow.rollout.eval_lane import EVAL_ID_BASE, EvalOutput, EvalRequest
from staleflow.runtime.controller.clients import DriverControl
from staleflow.runtime.driver.eval_rounds import EvalRound, EvalRounds
from tests.staleflow.runtime.fakes import Actor, ActorDied, FakeRay

HELDOUT = PromptDataset(
    "h", [np.array([3, 4 + p], np.int32) for p in range(5)], [str(p) for p in range(5)]
)


def _out(eval_id: int, n: int, version: int = 2) -> EvalOutput:
    return EvalOutput(eval_id, np.full(n, 7, np.int32), np.full(n, version, np.int32), "stop")


def test_problems_are_dealt_whole_to_the_instances_in_turn():
    r = EvalRound(4, HELDOUT, samples=2, k=1, instances=[0, 3], first_id=EVAL_ID_BASE + 10)
    assert sorted(r.requests) == [0, 3]
    # problems 0, 2, 4 on instance 0; 1, 3 on instance 3; both samples of each together
    got = {i: [int(q.prompt[1]) - 4 for q in reqs] for i, reqs in r.requests.items()}
    assert got == {0: [0, 0, 2, 2, 4, 4], 3: [1, 1, 3, 3]}
    ids = [q.eval_id for reqs in r.requests.values() for q in reqs]
    assert (
        sorted(ids)
        == list(range(EVAL_ID_BASE + 10, EVAL_ID_BASE + 20))
        == list(range(EVAL_ID_BASE + 10, r.next_id))
    )
    assert r.waiting_on() == {0, 3} and not r.complete


def test_a_lost_instance_takes_its_problems_and_the_rest_is_scored_by_hand():
    r = EvalRound(1, HELDOUT, samples=2, k=1, instances=[0, 1])
    by_id = {q.eval_id: i for i, reqs in r.requests.items() for q in reqs}
    todo = r.received(
        [_out(q.eval_id, 3, version=v) for q, v in zip(r.requests[0], [1, 2] * 3, strict=True)]
    )
    assert [answer for _, _, answer in todo] == ["0", "0", "2", "2", "4", "4"]
    assert r.received([_out(EVAL_ID_BASE + 999, 1)]) == []  # not of this round: ignored
    r.lost(1)  # problems 1 and 3 go with it
    assert r.waiting_on() == set() and not r.complete  # still scoring instance 0's
    # rewards: problem 0 right twice, problem 2 once, problem 4 never
    r.scored([t[0] for t in todo], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert r.complete and all(i == 0 for i in (by_id[t[0]] for t in todo))
    s = r.scores()
    assert s is not None and (s.problems, s.samples, s.k) == (3, 2, 1)
    assert s.mean_at_k == pytest.approx(3 / 6)
    assert s.pass_at_k == pytest.approx((1.0 + 0.5 + 0.0) / 3)  # pass@1 = c / n each
    assert (s.version_min, s.version_max) == (1, 2)


def test_nothing_scored_is_no_scores():
    r = EvalRound(1, HELDOUT, samples=1, k=1, instances=[0])
    r.lost(0)
    assert r.complete and r.scores() is None


# -- over Ray's calling convention ----------------------------------------------------------


class _Control:
    def __init__(self, members: dict) -> None:
        self.held: int | None = 2
        self._members = members
        self.done: list = []

    def eval_due(self):
        return self.held

    def members(self):
        return {i: (f"{i}.0", h) for i, h in self._members.items()}

    def eval_done(self, step, scores):
        self.done.append((step, scores))
        self.held = None  # the plane published the record


class _Instance:
    """Answers each request at once with 1 + (id mod 3) tokens; or is dead."""

    def __init__(self, dead: bool = False) -> None:
        self.dead = dead
        self.queued: list[EvalRequest] = []

    def submit_eval(self, requests):
        if self.dead:
            raise ActorDied("the actor died")
        self.queued += requests
        return len(requests)

    def take_eval(self):
        out, self.queued = [_out(q.eval_id, 1 + q.eval_id % 3) for q in self.queued], []
        return out


class _Worker:
    def __init__(self, dead: bool = False) -> None:
        self.dead, self.calls = dead, 0

    def score_eval(self, responses):
        self.calls += 1
        if self.dead:
            raise ActorDied("the reward worker died")
        return [float(len(tokens) % 2) for tokens, _ in responses]  # length parity


def test_a_round_over_actors_survives_a_dead_instance_and_a_dead_reward_worker():
    live, dead = _Instance(), _Instance(dead=True)
    control = _Control({0: Actor(live), 1: Actor(dead)})
    bad, good = _Worker(dead=True), _Worker()
    rounds = EvalRounds(
        FakeRay(),
        DriverControl(Actor(control), FakeRay()),
        lambda: {"reward/0": Actor(bad), "reward/1": Actor(good)},
        HELDOUT,
        samples=2,
        k=2,
    )
    rounds.finish(poll_s=0)
    ((step, scores),) = control.done
    assert step == 2 and bad.calls == 1 and good.calls >= 1  # rescored by the live one
    # instance 0 holds problems 0, 2, 4: ids base+0..1, base+4..5, base+8..9, of length
    # 1 + id % 3 (base % 3 == 1): 2 3 | 3 1 | 1 2 tokens; rewards [0, 1], [1, 1], [1, 0]
    assert EVAL_ID_BASE % 3 == 1
    assert scores is not None and scores.problems == 3
    assert scores.mean_at_k == pytest.approx(4 / 6) and scores.pass_at_k == pytest.approx(1.0)
    assert rounds.rounds == 1 and not rounds.running


def test_an_evaluation_that_fails_is_given_up_and_its_record_goes_out_without_it():
    class Broken(_Worker):
        def score_eval(self, responses):
            raise ValueError("the reward function's process is gone")

    control = _Control({0: Actor(_Instance())})
    rounds = EvalRounds(
        FakeRay(),
        DriverControl(Actor(control), FakeRay()),
        lambda: {"r": Actor(Broken())},
        HELDOUT,
        samples=1,
        k=1,
    )
    assert rounds.pending()
    rounds.finish(poll_s=0)
    assert control.done == [(2, None)] and not rounds.pending()
