"""The environment stage against the real trajectory server: a model turn with a tool
call goes back to the queue with the tool's answer appended (mask False, V_traj kept),
the answer turn completes with the environment's score, and what goes wrong is one
trajectory's, in its record."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from staleflow.envs import EnvSample, EpisodeLimits
from staleflow.envs.calculator import (
    CalculatorEnvironment,
    calculator_samples,
    calculator_tokenizer,
)
from staleflow.envs.formats import PlainFormat, episode_dataset
from staleflow.envs.tool_calls import format_tool_call, format_tool_response
from staleflow.rollout.instance import Finished
from staleflow.runtime.interface import Rewarded
from staleflow.runtime.workers.env_stage import EnvironmentStage, turns_of
from staleflow.runtime.workers.reward_stage import RewardStage
from tests.staleflow.runtime.env_turns import model_turn
from trajectory_server import (
    FinishedTrajectory,
    RewardTask,
    RoutedTrajectory,
    TrajectoryServer,
    TrajectoryServerConfig,
    TrajState,
)

TOK = calculator_tokenizer()
FMT = PlainFormat(TOK)


class _Source:
    def __init__(self) -> None:
        self._samples = list(
            episode_dataset(CalculatorEnvironment(), calculator_samples(size=8), FMT)
        )

    def next_sample(self):
        return self._samples.pop(0) if self._samples else None


def _never_scored(items: Sequence[tuple[int, str, str]]) -> list:
    raise AssertionError("an environment task is scored by its environment")


class Harness:
    def __init__(
        self,
        env: CalculatorEnvironment | None = None,
        max_turns: int = 4,
        ts: TrajectoryServer | None = None,
        step_timeout_s: float = 0.0,
        fmt: PlainFormat = FMT,
    ) -> None:
        self.ts = ts or TrajectoryServer(
            TrajectoryServerConfig(eta=1, batch_size=1, group_size=2), _Source()
        )
        self.rewarded: list[Rewarded] = []
        self.slept: list[float] = []
        rewards = RewardStage(_never_scored, TOK.decode, self.ts, self.rewarded.extend, "w")
        self.stage = EnvironmentStage(
            env or CalculatorEnvironment(latency_scale_s=0.2),
            fmt,
            EpisodeLimits(max_turns=max_turns, max_tokens=256),
            self.ts,
            rewards,
            worker_id="w",
            step_timeout_s=step_timeout_s,
            sleep=self.slept.append,
        )

    def turn(
        self, routed: RoutedTrajectory, text: str, version: int, reason: str = "stop"
    ) -> list[int]:
        """The instance generated ``text`` and eos after what it was routed with."""
        return self.stage.process([model_turn(self.ts, routed, TOK, text, version, reason)])


def _call(routed: RoutedTrajectory) -> str:
    expression = EnvSample.from_json(routed.answer).prompt.removesuffix("=")
    return format_tool_call("calculator", {"expression": expression})


def test_a_tool_call_turn_is_queued_with_the_answer_then_the_episode_is_scored() -> None:
    h = Harness()
    first, other = h.ts.route([0, 1], 3, "i0")
    sample = EnvSample.from_json(first.answer)
    assert h.turn(first, _call(first), version=3) == []  # not completed: a next turn
    assert h.ts.state_of(0) is TrajState.QUEUED and len(h.slept) == 1 and h.slept[0] >= 0.2
    (again,) = h.ts.route([0], None, "i1")  # another instance, a newer version
    assert again.v_traj == 3
    obs = ~again.mask
    assert TOK.decode(again.tokens[obs]) == format_tool_response(sample.answer)
    assert (again.logprobs[obs] == 0).all() and (again.versions[obs] == 3).all()
    assert turns_of(again.mask) == [(0, int(np.argmax(obs)))]
    assert h.turn(again, sample.answer, version=4) == [0]
    assert h.turn(other, "7", version=3) == [1]  # answers at once, wrong (or lucky)
    batch = h.ts.take_batch([first.group_id])
    done = {t.traj_id: t for t in batch.groups[0].trajectories}
    assert done[0].reward == 1.0 and done[0].finish_reason == "done"
    assert done[0].info["turns"] == 2 and done[0].info["tool_calls"] == 1
    assert done[0].mask.tolist() == again.mask.tolist() + [True] * (len(sample.answer) + 1)
    assert done[1].info["turns"] == 1 and done[1].reward == float(sample.answer == "7")
    assert {r.traj_id for r in h.rewarded} == {0, 1}
    by_id = {r.traj_id: r for r in h.rewarded}
    assert (by_id[0].turns, by_id[0].tool_calls, by_id[0].env_errors) == (2, 1, 0)
    assert by_id[0].tool_wait_s == pytest.approx(h.slept[0])


def test_errors_and_limits_end_one_episode_and_say_why() -> None:
    h = Harness(max_turns=2)
    a, b = h.ts.route([0, 1], 0, "i0")
    h.turn(a, "<tool_call>{oops</tool_call>", version=0)  # malformed: answered "error"
    (a2,) = h.ts.route([0], None, "i0")
    assert TOK.decode(a2.tokens[~a2.mask]) == format_tool_response("error")
    h.turn(a2, _call(a2), version=0)  # the last allowed turn called a tool again
    h.turn(b, _call(b)[:20], version=0, reason="length")  # cut by the token budget
    done = {t.traj_id: t for t in h.ts.take_batch([a.group_id]).groups[0].trajectories}
    assert done[0].finish_reason == "max_turns" and done[0].reward == 0.0
    assert done[0].info["env_errors"] == 1 and "not valid JSON" in str(done[0].info["env_error"])
    assert done[0].info["tool_calls"] == 2 and done[0].info["tool_errors"] == 1
    assert done[1].finish_reason == "max_tokens" and done[1].info["turns"] == 1


class _Broken(CalculatorEnvironment):
    def step(self, state, turn):
        raise RuntimeError("the tool's server is down")


def test_an_environment_that_raises_costs_its_trajectory_only() -> None:
    h = Harness(env=_Broken())
    a, _ = h.ts.route([0, 1], 0, "i0")
    assert h.turn(a, _call(a), version=0) == [0]
    (r,) = h.rewarded
    assert r.reward == 0.0 and "the tool's server is down" in r.error
    assert r.finish_reason == "env_error" and h.stage.errors == 1


def test_a_trajectory_aborted_during_its_tool_call_is_dropped_late() -> None:
    h = Harness()
    a, _ = h.ts.route([0, 1], 0, "i0")
    new = np.append(TOK.encode(_call(a)), TOK.eos_id).astype(np.int32)
    t = RewardTask(a.traj_id, a.group_id, 0, a.sample_id, a.answer, a.prompt, new,
                   np.zeros(len(new), np.float32), np.zeros(len(new), np.int32), "stop")  # fmt: skip
    h.ts.hand_to_reward([FinishedTrajectory(0, t.tokens, t.logprobs, t.versions, "stop")], "w")
    h.ts.abort([0])  # redundancy dropped it while its tool ran
    assert h.stage.process([Finished(t, 0)]) == [] and h.stage.continued == 0


def test_a_tool_call_cut_by_a_stop_runs_again_after_the_resume_and_answers_the_same() -> None:
    from staleflow.runtime.workers.reward_stage import finished_from_task
    from trajectory_server import wire

    straight, stopped = Harness(), Harness()
    for h in (straight, stopped):
        a, _ = h.ts.route([0, 1], 0, "i0")
        h.turn(a, _call(a), version=0)
        (again,) = h.ts.route([0], None, "i0")
    # the second call: one run steps it straight through; the other stops while its tool
    # runs (handed to its worker, never answered), then resumes from its checkpoint
    straight.turn(again, _call(again), version=1)
    new = np.append(TOK.encode(_call(again)), TOK.eos_id).astype(np.int32)
    tokens = np.concatenate([again.tokens, new])
    mask = np.concatenate([again.mask, np.ones(len(new), bool)])
    versions = np.concatenate([again.versions, np.ones(len(new), np.int32)])
    logprobs = np.concatenate([again.logprobs, np.full(len(new), -0.5, np.float32)])
    stopped.ts.hand_to_reward(
        [FinishedTrajectory(0, tokens, logprobs, versions, "stop", mask)], "w"
    )
    state = wire.unpack_plain(wire.pack_plain(stopped.ts.export_state()))
    resumed = Harness(ts=TrajectoryServer.restore(stopped.ts.config, _Source(), state))
    (task,) = resumed.ts.reassign_rewards(None, "w")
    assert resumed.stage.process([finished_from_task(task)]) == []
    (after_resume,) = resumed.ts.route([0], None, "i1")
    (after_straight,) = straight.ts.route([0], None, "i1")
    assert after_resume.tokens.tolist() == after_straight.tokens.tolist()
    assert after_resume.mask.tolist() == after_straight.mask.tolist()
    assert resumed.ts.env_states([0]) == straight.ts.env_states([0])
    assert resumed.slept == straight.slept[1:]  # the tool ran again, as long


class _Stuck(CalculatorEnvironment):
    """A step that never returns until the test lets it."""

    def __init__(self) -> None:
        super().__init__(latency_scale_s=0.0)
        self.release = threading.Event()

    def step(self, state, turn):
        self.release.wait(30)
        return super().step(state, turn)


class _SlowFor(CalculatorEnvironment):
    """Steps the turn ``slow`` only once the test lets it; any other turn at once."""

    def __init__(self, slow: str) -> None:
        super().__init__(latency_scale_s=0.0)
        self.slow, self.release = slow, threading.Event()

    def step(self, state, turn):
        if turn.text == self.slow:
            self.release.wait(30)
        return super().step(state, turn)


def test_a_fast_tool_takes_its_next_turn_while_a_slow_one_of_its_batch_still_waits() -> None:
    h = Harness()
    a, b = h.ts.route([0, 1], 0, "i0")
    slow = _call(a)
    env = _SlowFor(slow)
    h.stage._env = env  # the harness's stage, stepping this environment
    fast = format_tool_call("calculator", {"expression": "1+1"})
    batch = [model_turn(h.ts, a, TOK, slow), model_turn(h.ts, b, TOK, fast)]
    done = threading.Thread(target=h.stage.process, args=(batch,))
    done.start()
    try:
        for _ in range(3000):  # b's next turn is queued while a's tool still runs
            if h.ts.state_of(1) is TrajState.QUEUED:
                break
            threading.Event().wait(0.01)
        assert h.ts.state_of(1) is TrajState.QUEUED
        assert h.ts.state_of(0) is TrajState.REWARDING and done.is_alive()
    finally:
        env.release.set()
        done.join(30)
    assert h.ts.state_of(0) is TrajState.QUEUED and h.stage.continued == 2


class _Accented(CalculatorEnvironment):
    def step(self, state, turn):
        step = super().step(state, turn)
        return replace(step, observation="résultat")  # not in the built-in alphabet


def test_a_step_past_its_limit_or_an_observation_that_cannot_be_encoded_ends_its_episode() -> None:
    stuck = _Stuck()
    try:
        h = Harness(env=stuck, step_timeout_s=0.05)
        a, _ = h.ts.route([0, 1], 0, "i0")
        assert h.turn(a, _call(a), version=0) == [0]
        (r,) = h.rewarded
        assert r.finish_reason == "env_error" and "env.step_timeout_s" in r.error
    finally:
        stuck.release.set()
    h = Harness(env=_Accented(latency_scale_s=0.0))
    a, _ = h.ts.route([0, 1], 0, "i0")
    assert h.turn(a, _call(a), version=0) == [0]
    (r,) = h.rewarded
    assert r.finish_reason == "env_error" and "not in the tokenizer's alphabet" in r.error


class _Silent(PlainFormat):
    def observation_ids(self, observation: str) -> np.ndarray:
        return np.zeros(0, np.int32)


def test_an_observation_of_no_tokens_ends_the_episode_instead_of_merging_two_turns() -> None:
    h = Harness(fmt=_Silent(TOK))
    a, _ = h.ts.route([0, 1], 0, "i0")
    assert h.turn(a, _call(a), version=0) == [0]
    (r,) = h.rewarded
    assert r.finish_reason == "env_error" and "no tokens" in r.error


def test_the_audit_trail_writes_down_each_episodes_mask_and_record(tmp_path) -> None:
    from staleflow.runtime.workers.audit_trail import AuditedBatches, read_audit

    h = Harness()
    first, other = h.ts.route([0, 1], 0, "i0")
    h.turn(first, _call(first), version=0)
    (again,) = h.ts.route([0], None, "i0")
    h.turn(again, EnvSample.from_json(again.answer).answer, version=0)
    h.turn(other, "7", version=0)
    AuditedBatches(h.ts, tmp_path / "audit.jsonl", lambda: 0).take_batch([first.group_id])
    lines = {a["traj_id"]: a for a in read_audit(tmp_path / "audit.jsonl")}
    two = lines[0]
    assert two["info"]["turns"] == 2 and two["info"]["tool_calls"] == 1
    assert len(turns_of(np.array(two["mask"], bool))) == 2
    assert two["finish_reason"] == "done"
    assert lines[1]["info"]["turns"] == 1 and "mask" not in lines[1]  # all the model's
    # the keys a resume must keep (the prompt, the trajectory) and the reward trained with
    assert {a["sample_id"] for a in lines.values()} == {first.sample_id}
    assert two["reward"] == 1.0 and lines[1]["reward"] == 0.0
