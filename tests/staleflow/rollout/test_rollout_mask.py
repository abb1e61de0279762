"""The loss mask travels through a rollout instance and the reward stage: a trajectory
that comes back with observation tokens (mask False) leaves with them still False and
with every token the engine added True, however it leaves (finished, interrupted,
reported, at a chunk's end); the reward stage stores that mask in the TS."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from staleflow.rollout.instance import Finished, RolloutInstance
from staleflow.runtime.workers.reward_stage import RewardStage
from tests.staleflow.runtime.fakes import ScriptedEngine
from trajectory_server.types import Completion, PartialTrajectory, RewardTask, RoutedTrajectory

PREFIX_MASK = [True, True, False, False, False]


def _routed(traj_id: int) -> RoutedTrajectory:
    # a first model turn (7, eos) and a three-token observation after it
    return RoutedTrajectory(
        traj_id,
        group_id=0,
        v_traj=0,
        sample_id=0,
        answer="",
        prompt=np.array([1, 5], np.int32),
        tokens=np.array([7, 2, 9, 9, 9], np.int32),
        logprobs=np.array([-0.5, -0.5, 0, 0, 0], np.float32),
        versions=np.zeros(5, np.int32),
        mask=np.array(PREFIX_MASK),
    )


def _wait_finished(instance: RolloutInstance, done: threading.Event) -> None:
    instance.start()
    assert done.wait(10), "the instance never finished the trajectory"
    instance.stop()


def test_a_finished_turn_keeps_the_observation_masked_and_trains_the_rest() -> None:
    got: list[Finished] = []
    done = threading.Event()

    def on_finished(fs: list[Finished]) -> None:
        got.extend(fs)
        done.set()

    # trajectory 3 of target 5 + 3 % 4: eight tokens, so three more than it came in with
    instance = RolloutInstance(
        0, ScriptedEngine(target=5), max_response=32, on_finished=on_finished
    )
    instance.submit([_routed(3)])
    _wait_finished(instance, done)
    (f,) = got
    assert len(f.task.tokens) == 8
    assert f.task.mask.tolist() == [*PREFIX_MASK, True, True, True]  # type: ignore[union-attr]


def test_interrupt_progress_and_chunk_ends_carry_the_mask() -> None:
    engine = ScriptedEngine(target=50, hold=lambda t: t == 4)
    instance = RolloutInstance(0, engine, max_response=64, on_finished=lambda fs: None)
    instance.submit([_routed(4)])
    engine.step()  # admits it; held: no token added
    assert instance.progress()[4].mask.tolist() == PREFIX_MASK  # type: ignore[union-attr]
    partial = instance.interrupt([4])[4]
    assert partial.mask.tolist() == PREFIX_MASK  # type: ignore[union-attr]

    chunks: list[PartialTrajectory] = []
    done = threading.Event()

    def on_chunk(ps: list[PartialTrajectory]) -> None:
        chunks.extend(ps)
        done.set()

    chunked = RolloutInstance(
        1,
        ScriptedEngine(target=50),
        max_response=64,
        on_finished=lambda fs: None,
        chunk_tokens=2,
        on_chunk=on_chunk,
    )
    chunked.submit([_routed(5)])
    _wait_finished(chunked, done)
    assert chunks[0].mask.tolist() == [*PREFIX_MASK, True, True]  # type: ignore[union-attr]


class _Sink:
    def __init__(self) -> None:
        self.completions: list[Completion] = []

    def complete_many(
        self, completions: Sequence[Completion], *, instance_id=None, worker_id=None
    ) -> tuple:
        self.completions.extend(completions)
        return ()


class _Scored:
    reward, error = 1.0, ""


def test_the_reward_stage_stores_the_mask_it_was_given() -> None:
    mask = np.array([True, False, True])
    task = RewardTask(
        1, 0, 0, 0, "x", np.array([1], np.int32), np.array([7, 9, 2], np.int32),
        np.zeros(3, np.float32), np.zeros(3, np.int32), "stop", mask,
    )  # fmt: skip
    sink = _Sink()
    stage = RewardStage(lambda items: [_Scored() for _ in items], str, sink, lambda r: None)
    # a trajectory built without a mask (single-turn code) trains every token
    plain = RewardTask(2, 0, 0, 0, "x", task.prompt, task.tokens, task.logprobs,
                       task.versions, "stop")  # fmt: skip
    stage.process([Finished(task, 0), Finished(plain, 0)])
    assert sink.completions[0].mask.tolist() == [True, False, True]  # type: ignore[union-attr]
    assert sink.completions[1].mask.all()  # type: ignore[union-attr]
