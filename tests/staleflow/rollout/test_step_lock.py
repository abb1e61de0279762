"""A control call on a busy instance (a route, an interrupt, the coordinator's snapshot)
waits at most for the step in progress, never for a run of steps: the generation thread
lets the calls that wait go first (``staleflow/rollout/step_lock.py``)."""

from __future__ import annotations

import threading
import time

import numpy as np

from staleflow.rollout.instance import RolloutInstance
from staleflow.rollout.step_lock import StepLock
from tests.staleflow.runtime.fakes import ScriptedEngine
from trajectory_server.types import RoutedTrajectory


class Busy(ScriptedEngine):
    """The fake engine with a step long enough for a control call to arrive during it."""

    def step(self):
        time.sleep(0.005)
        return super().step()


def _routed(traj_id: int) -> RoutedTrajectory:
    none_i, none_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return RoutedTrajectory(
        traj_id, 0, 0, 0, "", np.arange(1, 5, dtype=np.int32), none_i, none_f, none_i
    )


def test_a_control_call_on_a_busy_instance_waits_for_one_step_at_most() -> None:
    engine = Busy(target=100_000, max_running=4)
    instance = RolloutInstance(0, engine, max_response=100_000, on_finished=lambda fs: None)
    instance.start()
    try:
        instance.submit([_routed(0), _routed(1)])
        while engine._steps < 3:  # the generation thread is stepping back to back
            time.sleep(0.001)
        waited = []
        for _ in range(40):
            before = engine._steps
            snap = instance.snapshot()
            waited.append(engine._steps - before)
            assert len(snap.run_trajs) == 2
        # the step in progress may end while the call waits; a second one never starts
        assert max(waited) <= 1, waited
        assert engine._steps > 3  # and the calls did not stop the stepping
    finally:
        instance.stop()


def test_the_generation_thread_waits_only_while_a_call_is_waiting() -> None:
    lock = StepLock()
    steps = 0
    stop = threading.Event()

    def generate() -> None:
        nonlocal steps
        while not stop.is_set():
            with lock.step():
                steps += 1

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            with lock:
                seen = steps
            with lock:
                assert steps - seen <= 1  # nothing else was waiting between the two calls
        t0 = steps
        deadline = time.monotonic() + 10
        while steps < t0 + 1000 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert steps >= t0 + 1000  # with no call waiting, it steps freely
    finally:
        stop.set()
        thread.join(5)
