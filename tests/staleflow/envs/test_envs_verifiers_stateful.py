"""A second kind of ``verifiers`` environment under StaleFlow's contract: a task with
**rollout state** (the library's ``StatefulToolEnv`` shape), written with the library's
own classes. Its toolset keeps the game in ``self.state`` (a ``vf.State`` subclass) across
the model's turns; its ``@vf.stop`` and rubric read ``trace.state``. In ``verifiers`` the
rollout serves that state to the tool servers over an HTTP channel; here the trajectory
carries it and the adapter is the channel (``staleflow.envs.verifiers_env``). Last,
``env.name`` names the taskset and the reward worker's own stage plays it on a local
JSONL file through the real TS, the state crossing the TS between turns.

The first kind, a stateless toolset: ``test_envs_verifiers.py``. Skips without the
``envs`` extra, like it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

vf = pytest.importorskip(
    "verifiers.v1",
    reason="needs the envs extra: pip install 'staleflow[envs]' (verifiers 0.4)",
)

from pydantic import Field  # noqa: E402  (verifiers's dependency)

from staleflow.envs import EnvSample, ModelTurn, make_environment  # noqa: E402
from staleflow.envs.base import EnvContractError  # noqa: E402
from staleflow.envs.formats import tool_tokenizer  # noqa: E402
from staleflow.envs.verifiers_env import VerifiersEnvironment  # noqa: E402
from tests.staleflow.runtime.env_turns import env_stage_on_file, model_turn  # noqa: E402


class GuessState(vf.State):
    guesses: list[int] = Field(default_factory=list)
    solved: bool = False


class HintsConfig(vf.ToolsetConfig):
    pass


class Hints(vf.Toolset[HintsConfig, GuessState]):
    """A per-task tool server: the secret comes from the task's data, the guesses so far
    from the rollout state."""

    async def setup_task(self, task: GuessData) -> None:
        self.secret = int(task.answer)

    @vf.tool
    def guess(self, number: int) -> str:
        """Guess the secret number; the answer is higher, lower or correct."""
        self.state.guesses.append(number)
        if number == self.secret:
            self.state.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"


class GuessData(vf.TaskData):
    answer: str
    system_prompt: str | None = "find the number with the guess tool"


class GuessTask(vf.Task[GuessData, GuessState, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Hints(HintsConfig())]

    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.state.solved)

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        return 1.0 / len(trace.state.guesses) if trace.state.solved else 0.0

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.state.guesses))

    @vf.stop
    def found(self, trace: vf.Trace) -> bool:
        return trace.state.solved


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> Iterator[GuessTask]:
        yield GuessTask(GuessData(prompt="1-100", answer="37"), self.config.task)


ROWS = [{"prompt": "1-100", "answer": "37"}, {"prompt": "1-10", "answer": 4}]
GUESS = '<tool_call>{"name":"hints_guess","arguments":{"number":%d}}</tool_call>'


def _turn(index: int, text: str) -> ModelTurn:
    return ModelTurn(index, text, np.zeros(0, np.int32))


def _through_the_ts(state: dict) -> dict:
    return json.loads(json.dumps(state))  # plain data, as the TS and checkpoints keep it


@pytest.fixture(scope="module")
def env() -> VerifiersEnvironment:
    return make_environment(f"{__name__}:GuessTaskset")  # type: ignore[return-value]


def test_the_rollout_state_lives_in_the_trajectory_and_the_rubric_reads_it(env) -> None:
    episode = env.start(EnvSample(0, "1-100", "37"), seed=0)
    (tool,) = episode.tools
    assert tool["function"]["name"] == "hints_guess"
    assert episode.state["tool_state"] == {"artifacts": {}, "guesses": [], "solved": False}
    step = env.step(_through_the_ts(episode.state), _turn(0, GUESS % 50))
    assert (step.observation, step.done, step.error) == ("lower", False, "")
    assert step.state["tool_state"]["guesses"] == [50]
    step = env.step(_through_the_ts(step.state), _turn(1, GUESS % 20))
    assert step.observation == "higher" and step.state["tool_state"]["guesses"] == [50, 20]
    step = env.step(_through_the_ts(step.state), _turn(2, GUESS % 37))
    # the @vf.stop read the state the tool wrote: the episode ends on the tool's answer
    assert (step.observation, step.done, step.info["stop"]) == ("correct", True, "found")
    assert step.state["tool_state"] == {"artifacts": {}, "guesses": [50, 20, 37], "solved": True}
    assert env.score(step.state) == pytest.approx(1.0 + 0.5 / 3)  # solved + quick
    # a reply without a call ends the episode unsolved: the rubric reads the state so far
    gave_up = env.step(_through_the_ts(episode.state), _turn(0, "I give up"))
    assert gave_up.done and env.score(gave_up.state) == 0.0


def test_trajectories_stepped_at_once_keep_their_own_state(env) -> None:
    # the stage steps several trajectories at once on its threads; each one's tools must
    # pull and push its own state, never another's
    samples = [EnvSample(i, "1-100", str(secret)) for i, secret in enumerate((10, 90, 50, 70))]
    states = [env.start(s, seed=s.sample_id).state for s in samples]
    with ThreadPoolExecutor(4) as pool:
        for guess in (50, 60):
            turn = _turn(0, GUESS % guess)
            steps = list(pool.map(lambda st, t=turn: env.step(st, t), states))
            states = [s.state for s in steps]
    assert [s["tool_state"]["guesses"] for s in states] == [[50, 60]] * 4
    assert [s["tool_state"]["solved"] for s in states] == [False, False, True, False]
    assert [s.observation for s in steps] == ["lower", "higher", "lower", "higher"]


def test_a_toolset_whose_state_the_task_does_not_keep_is_refused() -> None:
    class PlainTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
        @classmethod
        def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
            return [Hints(HintsConfig())]

    class PlainTaskset(vf.Taskset[PlainTask, vf.TasksetConfig]):
        def load(self) -> Iterator[PlainTask]:
            yield from ()

    with pytest.raises(EnvContractError, match=r"Hints keeps rollout state GuessState"):
        VerifiersEnvironment(PlainTaskset)


def test_env_name_plays_the_stateful_taskset_on_a_local_file_through_the_ts(
    tmp_path: Path,
) -> None:
    tok = tool_tokenizer("hints_guess", arguments=("number",))
    _, ts, stage = env_stage_on_file(tmp_path, f"{__name__}:GuessTaskset", ROWS, tok, "games.jsonl")

    def turn(routed, text: str) -> list[int]:
        return stage.process([model_turn(ts, routed, tok, text)])

    (routed,) = ts.route([0], 0, "i0")
    observations = []
    for guess in (50, 25, 37):  # each turn leaves the TS and comes back with its state
        done = turn(routed, GUESS % guess)
        if done:
            break
        (routed,) = ts.route([0], None, "i0")
        observations.append(tok.decode(routed.tokens[~routed.mask]).split("</tool_response>"))
    assert done == [0]
    assert [o[-2].rsplit(">", 1)[-1] for o in observations] == ["lower", "higher"]
    traj = ts.take_batch([routed.group_id]).groups[0].trajectories[0]
    # ended by the task's @vf.stop on the tool's state, scored by its rubric from it
    assert traj.finish_reason == "done" and traj.reward == pytest.approx(1.0 + 0.5 / 3)
    assert traj.info["turns"] == 3 and traj.info["tool_calls"] == 3
    stage.close()
