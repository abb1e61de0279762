"""Evaluation requests on a rollout instance: the lane's own rules, then the path through
the instance host with the real embedded engine (a micro model) beside training
trajectories. They are generated at the instance's weights, at most ``eval_running`` of
them in the engine at once, and never reach the trajectory server (no route, no partial,
no progress report names them) nor the snapshot the coordinator plans with, nor
``held()`` that the end-of-run audit counts. No Ray."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from staleflow.engines.base import EngineOutput
from staleflow.rollout.eval_lane import EVAL_ID_BASE, EvalLane, EvalRequest

PROMPT = np.array([1, 5, 6, 7], np.int32)


def _eval(i: int, prompt: np.ndarray = PROMPT) -> EvalRequest:
    return EvalRequest(EVAL_ID_BASE + i, prompt)


def test_the_lane_caps_what_enters_the_engine_and_refuses_bad_requests():
    lane = EvalLane(max_response=6, max_running=2)
    assert not lane
    lane.add([_eval(i) for i in range(3)])
    first = lane.admit()
    assert [r.traj_id for r in first] == [EVAL_ID_BASE, EVAL_ID_BASE + 1]
    assert all(r.max_response == 6 and len(r.tokens) == 0 for r in first)
    assert lane.admit() == [] and lane.pending == 3  # the third waits in the lane
    assert lane.owns(EVAL_ID_BASE) and not lane.owns(EVAL_ID_BASE + 2) and not lane.owns(0)
    out = EngineOutput(EVAL_ID_BASE, np.array([3, 4], np.int32), np.zeros(2, np.float32),
                       np.array([0, 1], np.int32), "stop")  # fmt: skip
    lane.finish(out)
    assert [r.traj_id for r in lane.admit()] == [EVAL_ID_BASE + 2]
    (done,) = lane.take()
    assert done.eval_id == EVAL_ID_BASE and done.versions.tolist() == [0, 1]
    assert lane.take() == []
    for bad, message in (
        ([_eval(-1)], "below EVAL_ID_BASE"),
        ([_eval(1)], "already here"),
        ([_eval(9, np.zeros(0, np.int32))], "empty prompt"),
    ):
        with pytest.raises(ValueError, match=message):
            lane.add(bad)
    assert lane.pending == 2  # a refused batch changed nothing


# -- through the instance host, with the embedded engine -------------------------------------

torch = pytest.importorskip("torch")


class _RecordingTS:
    """The trajectory server's side of an instance, recording every id it is sent."""

    def __init__(self, routed: Sequence) -> None:
        self._routed = {r.traj_id: r for r in routed}
        self.seen: set[int] = set()

    def route(self, traj_ids, v_traj, instance_id, *, skip_unavailable=False):
        self.seen.update(traj_ids)
        return tuple(self._routed[t] for t in traj_ids)

    def interrupt_return(self, partials, *, instance_id=None):
        self.seen.update(p.traj_id for p in partials)

    def report_progress(self, partials, instance_id):
        self.seen.update(p.traj_id for p in partials)
        return tuple(p.traj_id for p in partials)

    def fork(self, traj_id, instance_id):
        self.seen.add(traj_id)
        return None


class _Weights:
    """The PS: every version holds the model's own weights."""

    def __init__(self, model) -> None:
        self.weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        self.latest = 0

    def fetch(self, at_least: int) -> tuple[int, Mapping[str, np.ndarray]]:
        return max(self.latest, at_least), self.weights


class _Counting:
    """The engine, counting the evaluation requests in it at every step (the instance
    steps it under its lock, so the count is consistent)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.most_evals = 0

    def step(self):
        state = self._engine.state()
        ids = [t for t, _ in state.running + state.waiting]
        self.most_evals = max(self.most_evals, sum(t >= EVAL_ID_BASE for t in ids))
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _routed(traj_id: int):
    from trajectory_server.types import RoutedTrajectory

    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return RoutedTrajectory(traj_id, 0, 0, traj_id, "x", PROMPT, empty_i, empty_f, empty_i)


def _wait(what, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_evaluation_requests_run_beside_trajectories_and_never_reach_the_ts():
    from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from staleflow.models import build_arithmetic_model
    from staleflow.runtime.workers.instance_host import InstanceHost

    model, tokenizer = build_arithmetic_model("micro")
    engine = _Counting(
        EmbeddedEngine(
            model,
            EmbeddedEngineConfig(
                kv_budget_tokens=512,
                max_running=8,
                max_seq_len=64,
                eos_token_id=tokenizer.eos_id,
            ),
        )
    )
    ts = _RecordingTS([_routed(0), _routed(1)])
    weights = _Weights(model)
    finished: list = []
    lock = threading.Lock()

    def on_finished(fs):
        with lock:
            finished.extend(fs)

    host = InstanceHost(
        0, engine, ts=ts, weights=weights, max_response=6, on_finished=on_finished, eval_running=2
    )
    weights.latest = 3
    assert host.start() == 3
    try:
        host.submit_eval([_eval(i) for i in range(5)])
        host.route([0, 1], {0: 3, 1: 3})
        snap = host.snapshot()
        assert {r.traj_id for r in snap.run_trajs + snap.wait_trajs} <= {0, 1}
        assert host.held() <= {0, 1}
        host.report_progress()  # only the trajectories' progress goes to the TS
        got: dict = {}

        def all_back() -> bool:
            got.update({o.eval_id: o for o in host.take_eval()})
            with lock:
                return len(got) == 5 and len(finished) == 2

        _wait(all_back)
    finally:
        host.stop()
    assert set(got) == {EVAL_ID_BASE + i for i in range(5)}
    for out in got.values():
        assert 1 <= len(out.tokens) <= 6 and out.finish_reason in ("stop", "length")
        assert out.versions.tolist() == [3] * len(out.tokens)  # the instance's weights
    assert sorted(f.task.traj_id for f in finished) == [0, 1]  # no evaluation among them
    assert ts.seen <= {0, 1}, "an evaluation request reached the trajectory server"
    assert 1 <= engine.most_evals <= 2  # eval_running: the rest waited in the lane
    assert host.held() == set()
