"""A ``verifiers`` environment (prime-rl's library) under StaleFlow's contract: the
taskset below is written with the library's own classes (``Taskset``, ``Task``,
``TaskData``, a ``Toolset`` with a ``@vf.tool``, ``@vf.reward``, ``@vf.metric`` and
``@vf.stop`` methods) and runs through the adapter (``staleflow.envs.verifiers_env``):
its tools answer the model's calls through the library's MCP server, its rubric scores
the episode. Last, ``env.name`` names the taskset and the reward worker's own stage plays
it on a local JSONL file through the real TS.

``verifiers`` is the optional ``envs`` extra, not in ``dev`` (its install took 106 s
here and its import about 7 s of CPU), so these tests skip where it is not installed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

vf = pytest.importorskip(
    "verifiers.v1",
    reason="needs the envs extra: pip install 'staleflow[envs]' (verifiers 0.4)",
)

from staleflow.envs import EnvSample, ModelTurn, make_environment  # noqa: E402
from staleflow.envs.base import EnvContractError  # noqa: E402
from staleflow.envs.formats import tool_tokenizer  # noqa: E402
from staleflow.envs.verifiers_env import VerifiersEnvironment  # noqa: E402
from tests.staleflow.runtime.env_turns import model_turn  # noqa: E402


class CalcConfig(vf.ToolsetConfig):
    pass


class Calc(vf.Toolset[CalcConfig]):
    @vf.tool
    def evaluate(self, expression: str) -> str:
        """Evaluate an expression of integers with + - and *."""
        if not expression or set(expression) - set("0123456789+-*"):
            raise ValueError(f"cannot evaluate {expression!r}")
        total = 0
        for term in expression.replace("-", "+-").split("+"):
            product = 1
            for factor in term.split("*"):
                product *= int(factor)
            total += product if term else 0
        return str(total)


class SumData(vf.TaskData):
    answer: str
    system_prompt: str | None = "add with the calculator"


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calc(CalcConfig())]

    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply.split("=")[-1].strip() == task.answer)

    @vf.reward(weight=0.5)
    async def used_the_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)

    @vf.stop
    def three_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 3


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        yield SumTask(SumData(prompt="12+30=", answer="42"), self.config.task)


ROWS = [{"prompt": "12+30=", "answer": "42"}, {"prompt": "6*7-2=", "answer": 40}]
CALL = '<tool_call>{"name":"calc_evaluate","arguments":{"expression":"%s"}}</tool_call>'


def _turn(index: int, text: str) -> ModelTurn:
    return ModelTurn(index, text, np.zeros(0, np.int32))


@pytest.fixture(scope="module")
def env() -> VerifiersEnvironment:
    return make_environment(f"{__name__}:SumTaskset")  # type: ignore[return-value]


def test_the_taskset_gives_its_messages_and_its_tools_as_the_harness_lists_them(env) -> None:
    assert isinstance(env, VerifiersEnvironment) and env.columns == ()
    episode = env.start(EnvSample(0, "12+30=", "42"), seed=5)
    assert episode.messages == (
        {"role": "system", "content": "add with the calculator"},
        {"role": "user", "content": "12+30="},
    )
    (tool,) = episode.tools
    assert tool["function"]["name"] == "calc_evaluate"  # <server>_<tool>
    assert tool["function"]["parameters"]["required"] == ["expression"]
    assert "Evaluate an expression" in tool["function"]["description"]
    data = episode.state["data"]
    assert (data["prompt"], data["answer"], data["idx"]) == ("12+30=", "42", 0)
    json.dumps(episode.state)  # plain data


def test_a_tool_call_is_answered_by_the_toolset_and_the_rubric_scores_the_episode(env) -> None:
    state = env.start(EnvSample(0, "12+30=", "42"), seed=0).state
    step = env.step(state, _turn(0, "let me add " + CALL % "12+30"))
    assert (step.observation, step.done, step.error) == ("42", False, "")
    assert step.info == {"tool_calls": 1, "tool_errors": 0}
    final = env.step(step.state, _turn(1, "12+30=42"))
    assert final.done and final.observation == ""
    assert env.score(final.state) == 1.5  # correct (1) + used the tool (0.5 x 1)
    assert env.score(env.step(state, _turn(0, "12+30=41")).state) == 0.0
    # the state is the conversation, as the trace the rubric read
    roles = [m["role"] for m in final.state["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert final.state["messages"][2]["content"] == "let me add"


@pytest.mark.parametrize(
    ("text", "observation", "error"),
    [
        (CALL % "12/30", "error: Error executing tool evaluate: cannot evaluate", "calc_evaluate"),
        ('<tool_call>{"name":"search","arguments":{}}</tool_call>', "error: unknown tool", ""),
        ("<tool_call>{not json</tool_call>", "error: tool call 1 is not valid JSON", "turn 0"),
    ],
)
def test_a_bad_call_is_the_trajectorys_error_and_the_episode_goes_on(
    env, text, observation, error
) -> None:
    state = env.start(EnvSample(0, "12+30=", "42"), seed=0).state
    step = env.step(state, _turn(0, text))
    assert step.observation.startswith(observation) and not step.done
    assert step.error and error in step.error
    assert step.info["tool_errors"] == 1


def test_a_trace_stop_condition_ends_the_episode(env) -> None:
    state = env.start(EnvSample(0, "12+30=", "42"), seed=0).state
    for i in range(3):
        step = env.step(state, _turn(i, CALL % "1+1"))
        state = step.state
    assert step.done and step.info["stop"] == "three_calls"
    assert env.score(state) == 0.5  # used the tool, never answered


def test_a_row_that_is_not_the_tasks_data_is_refused_by_field() -> None:
    class NeedsLevel(vf.TaskData):
        level: int

    class LevelTask(vf.Task[NeedsLevel, vf.State, vf.TaskConfig]):
        pass

    class LevelTaskset(vf.Taskset[LevelTask, vf.TasksetConfig]):
        def load(self) -> Iterator[LevelTask]:
            yield from ()

    env = VerifiersEnvironment(LevelTaskset)
    assert env.columns == ("level",)  # every row must hold it
    with pytest.raises(EnvContractError, match="level"):
        env.start(EnvSample(0, "q", "a", {"level": "high"}), seed=0)


class _Source:
    def __init__(self, dataset) -> None:
        self._samples = list(dataset)

    def next_sample(self):
        return self._samples.pop(0) if self._samples else None


def test_env_name_runs_the_taskset_on_a_local_file_through_the_ts(tmp_path: Path) -> None:
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import build_dataset
    from staleflow.runtime.driver.launch_checks import preflight
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.workers.specs import RewardSpec, build_reward_stage
    from trajectory_server import (
        TrajectoryServer,
        TrajectoryServerConfig,
    )

    tok = tool_tokenizer("calc_evaluate", arguments=("expression",))
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(
        None,
        [
            "data.task=env",
            f"env.name={__name__}:SumTaskset",
            f"data.path={path}",
            f"model.checkpoint={tmp_path}",  # a folder: the policy is never loaded here
        ],
    )
    plan = plan_run(cfg)
    preflight(plan)
    dataset = build_dataset(plan.task, tok)
    assert tok.decode(dataset[1].prompt_ids) == "6*7-2="
    spec = plan.environment()
    assert spec is not None
    ts = TrajectoryServer(
        TrajectoryServerConfig(eta=0, batch_size=1, group_size=1), _Source(dataset)
    )
    stage = build_reward_stage(
        RewardSpec(plan.reward, ("char", tok.alphabet), spec), ts, [].extend, "w"
    )

    def turn(routed, text: str) -> list[int]:
        return stage.process([model_turn(ts, routed, tok, text)])

    (first,) = ts.route([0], 0, "i0")
    assert turn(first, CALL % "12+30") == []
    (again,) = ts.route([0], None, "i0")
    assert tok.decode(again.tokens[~again.mask]) == "<tool_response>42</tool_response>"
    assert turn(again, "12+30=42") == [0]
    done = ts.take_batch([first.group_id]).groups[0].trajectories[0]
    assert (done.reward, done.finish_reason) == (1.5, "done")
    assert done.info["turns"] == 2 and done.info["tool_calls"] == 1
    stage.close()
