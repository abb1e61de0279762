"""``data.task=env``: a user's environment, named ``module:attribute``, runs on the
problems of the user's file (JSONL, Parquet, a Hugging Face datasets folder). The
environment here is a real one, defined in this module: guessing a number, with the
range a per-row column. The launcher refuses, before anything starts, an environment
that does not import, is not an environment or cannot start on the rows, and rows that
lack the fields it reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from staleflow.envs import EnvSample, EnvState, Episode, ModelTurn, Step
from staleflow.envs.formats import tool_tokenizer
from staleflow.runtime.errors import LaunchError
from tests.staleflow.runtime.env_turns import model_turn
from trajectory_server import (
    RoutedTrajectory,
    TrajectoryServer,
    TrajectoryServerConfig,
)

TOK = tool_tokenizer("guess")
ROWS = [
    {"prompt": "guess my number from 1 to 9", "answer": 7, "high": 9},
    {"prompt": "guess my number from 1 to 5", "answer": "2", "high": 5},
]


class GuessEnv:
    """The model guesses a number from 1 to the row's ``high``; the environment answers
    higher or lower. The reward is 1 / guesses once it is found."""

    name = "guess"
    columns = ("high",)  # read from each sample's extra

    def start(self, sample: EnvSample, seed: int) -> Episode:
        state: EnvState = {"secret": int(sample.answer), "high": int(sample.extra["high"])}
        return Episode(({"role": "user", "content": sample.prompt},), (), {**state, "tries": 0})

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        tries = int(state["tries"]) + 1  # type: ignore[arg-type]
        after = {**state, "tries": tries}
        try:
            guess = int(turn.text.strip())
        except ValueError:
            return Step(after, observation="a number", error=f"not a number: {turn.text!r}")
        if guess == state["secret"]:
            return Step({**after, "won": True}, done=True, info={"guesses": 1})
        hint = "higher" if guess < int(state["secret"]) else "lower"  # type: ignore[arg-type]
        return Step(after, observation=hint, info={"guesses": 1})

    def score(self, state: EnvState) -> float:
        return 1.0 / int(state["tries"]) if state.get("won") else 0.0  # type: ignore[arg-type]


class NoStep:
    """Not an environment: it cannot answer a turn."""

    name = "nostep"

    def start(self, sample: EnvSample, seed: int) -> Episode:
        return Episode((), (), {})

    def score(self, state: EnvState) -> float:
        return 0.0


def _write(rows: list[dict], tmp_path: Path, kind: str) -> Path:
    if kind == "jsonl":
        path = tmp_path / "problems.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "problems.parquet"
        # one type per column: answers as text
        pq.write_table(
            pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), path
        )
    else:
        import datasets

        path = tmp_path / "problems"
        fixed = [{**r, "answer": str(r["answer"])} for r in rows]
        datasets.Dataset.from_list(fixed).save_to_disk(str(path))
    return path


def _config(tmp_path: Path, path: Path, env: str = f"{__name__}:GuessEnv", *more: str):
    from staleflow.config import load_config

    return load_config(
        None,
        [
            "data.task=env",
            f"env.name={env}",
            f"data.path={path}",
            f"model.checkpoint={tmp_path}",  # a folder: the policy is never loaded here
            "env.max_turns=3",
            *more,
        ],
    )


class _Source:
    def __init__(self, dataset) -> None:
        self._samples = list(dataset)

    def next_sample(self):
        return self._samples.pop(0) if self._samples else None


def _turn(ts, stage, routed: RoutedTrajectory, text: str) -> list[int]:
    """The instance generated ``text`` and the end of the turn; the stage steps it."""
    return stage.process([model_turn(ts, routed, TOK, text)])


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf"])
def test_a_users_environment_plays_its_own_problems(tmp_path, kind) -> None:
    from staleflow.runtime.driver.launch import build_dataset
    from staleflow.runtime.driver.launch_checks import preflight
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.workers.specs import RewardSpec, build_reward_stage

    plan = plan_run(_config(tmp_path, _write(ROWS, tmp_path, kind)))
    preflight(plan)  # the environment imports and builds, every row reads
    dataset = build_dataset(plan.task, TOK)
    assert len(dataset) == 2
    assert TOK.decode(dataset[0].prompt_ids) == ROWS[0]["prompt"]  # the environment's message
    assert EnvSample.from_json(dataset[1].answer) == EnvSample(
        1, ROWS[1]["prompt"], "2", {"high": 5}
    )

    # the reward worker's stage, built from the config as a worker builds it: the sample
    # reaches the environment through the TS, the episode takes turns and is scored
    spec = plan.environment()
    assert spec is not None and spec.name == f"{__name__}:GuessEnv" and spec.max_turns == 3
    ts = TrajectoryServer(
        TrajectoryServerConfig(eta=0, batch_size=1, group_size=2), _Source(dataset)
    )
    rewarded: list = []
    stage = build_reward_stage(
        RewardSpec(plan.reward, ("char", TOK.alphabet), spec), ts, rewarded.extend, "w"
    )
    first, second = ts.route([0, 1], 0, "i0")
    assert _turn(ts, stage, first, "4") == []  # too low: a next turn
    (again,) = ts.route([0], None, "i0")
    assert TOK.decode(again.tokens[~again.mask]) == "<tool_response>higher</tool_response>"
    assert _turn(ts, stage, again, "7") == [0]
    # the group's other trajectory, on the same problem
    assert _turn(ts, stage, second, "seven") == []  # a bad turn is its error, not a crash
    (last,) = ts.route([1], None, "i0")
    assert _turn(ts, stage, last, "9") == []  # a third turn is allowed (env.max_turns=3)
    (final,) = ts.route([1], None, "i0")
    assert _turn(ts, stage, final, "8") == [1]
    done = {t.traj_id: t for t in ts.take_batch([first.group_id]).groups[0].trajectories}
    assert (done[0].reward, done[0].finish_reason, done[0].info["guesses"]) == (0.5, "done", 2)
    assert done[1].reward == 0.0 and done[1].finish_reason == "max_turns"
    assert "not a number" in str(done[1].info["env_error"]) and done[1].info["turns"] == 3
    stage.close()


def _refused(cfg, monkeypatch) -> str:
    """What ``launch`` says, refusing ``cfg`` before it places anything on Ray."""
    from staleflow.runtime.driver import launch as launch_module

    def placed(*args, **kwargs):
        raise AssertionError("the launch went on to Ray before refusing")

    monkeypatch.setattr(launch_module, "place", placed)
    with pytest.raises(LaunchError) as caught:
        launch_module.launch(cfg)
    return str(caught.value)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ("no_such_package.envs:Env", "could not be loaded.*No module named 'no_such_package'"),
        (f"{__name__}:Missing", "could not be loaded.*has no attribute 'Missing'"),
        (f"{__name__}:NoStep", "NoStep, which lacks name, start, step or score"),
        (f"{__name__}:ROWS", "is a list: name a class or factory"),
        ("guess", "unknown environment 'guess'.*module:attribute"),
    ],
)
def test_an_environment_that_is_not_there_or_not_one_is_refused_first(
    tmp_path, monkeypatch, env, said
) -> None:
    message = _refused(_config(tmp_path, _write(ROWS, tmp_path, "jsonl"), env), monkeypatch)
    assert message.startswith(f"env.name={env}: ")
    assert re.search(said, message), message


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        ([ROWS[0], {"prompt": "guess", "answer": 1}], r"row 2, field 'high': missing"),
        ([{"question": "guess", "answer": 1, "high": 3}], r"row 1, field 'prompt': missing"),
        ([{"prompt": "guess", "answer": 1, "high": "nine"}], r"start\(\) failed on the first row"),
    ],
)
def test_rows_without_what_the_environment_reads_are_refused_first(
    tmp_path, monkeypatch, rows, said
) -> None:
    message = _refused(_config(tmp_path, _write(rows, tmp_path, "jsonl")), monkeypatch)
    assert re.search(said, message), message
