"""The environment contract: the episode-end rule, plain state, keyed draws, the registry."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import numpy as np
import pytest

from staleflow.envs import (
    ENVIRONMENTS,
    FINISH_DONE,
    FINISH_MAX_TOKENS,
    FINISH_MAX_TURNS,
    EnvContractError,
    EnvSample,
    EnvState,
    Episode,
    EpisodeLimits,
    ModelTurn,
    Step,
    after_step,
    check_plain,
    environment_names,
    keyed_uniform,
    make_environment,
    register_environment,
)


class CountdownEnv:
    """Ends after ``turns`` model turns; the reward is the number of turns that said 'ok'."""

    name = "countdown"

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    def start(self, sample: EnvSample, seed: int) -> Episode:
        return Episode(({"role": "user", "content": sample.prompt},), (), {"left": self.turns})

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        left = int(state["left"]) - 1  # type: ignore[arg-type]
        ok = int(state.get("ok", 0)) + (turn.text == "ok")  # type: ignore[arg-type]
        return Step({"left": left, "ok": ok}, observation=f"{left} left", done=left == 0)

    def score(self, state: EnvState) -> float:
        return float(state.get("ok", 0))  # type: ignore[arg-type]


def _step(done: bool = False) -> Step:
    return Step({}, observation="x", done=done)


def test_after_step_done_turns_and_tokens_in_that_order() -> None:
    limits = EpisodeLimits(max_turns=3, max_tokens=20)
    obs = np.arange(5, dtype=np.int32)
    go = after_step(limits, turns_done=1, response_tokens=10, step=_step(), observation_ids=obs)
    assert not go.ended and go.observation_ids.tolist() == obs.tolist()
    done = after_step(
        limits, turns_done=3, response_tokens=19, step=_step(True), observation_ids=obs
    )
    assert done.finish == FINISH_DONE and len(done.observation_ids) == 0
    last = after_step(limits, turns_done=3, response_tokens=1, step=_step(), observation_ids=obs)
    assert last.finish == FINISH_MAX_TURNS and len(last.observation_ids) == 0
    # 15 + 5 leaves no token for the next turn: ended, the observation not appended
    full = after_step(limits, turns_done=1, response_tokens=15, step=_step(), observation_ids=obs)
    assert full.finish == FINISH_MAX_TOKENS and len(full.observation_ids) == 0
    room = after_step(limits, turns_done=1, response_tokens=14, step=_step(), observation_ids=obs)
    assert not room.ended


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 1 turn"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="max_tokens"):
        EpisodeLimits(max_tokens=0)


def test_check_plain_names_the_offending_part() -> None:
    state = {"a": [1, 2.5, "x", None, True, {"b": []}]}
    check_plain(state)
    assert msgpack.unpackb(msgpack.packb(state)) == state
    with pytest.raises(EnvContractError, match=r"state\['a'\]\[1\] is a tuple"):
        check_plain({"a": [1, (2, 3)]})
    with pytest.raises(EnvContractError, match="ndarray"):
        check_plain({"ids": np.arange(3)})
    with pytest.raises(EnvContractError, match="str keys"):
        check_plain({"a": {1: 2}})
    with pytest.raises(EnvContractError, match="finite"):
        check_plain({"a": float("nan")})


def test_keyed_uniform_is_keyed_and_in_range() -> None:
    draws = [keyed_uniform(7, "latency", t) for t in range(200)]
    assert draws == [keyed_uniform(7, "latency", t) for t in range(200)]
    assert all(0.0 < d < 1.0 for d in draws)
    assert len(set(draws)) == 200
    assert keyed_uniform(8, "latency", 0) != draws[0]
    assert 0.35 < float(np.mean(draws)) < 0.65


def test_registry_builds_a_registered_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENVIRONMENTS, "countdown", f"{__name__}:CountdownEnv")
    env = make_environment("countdown", turns=2)
    assert "countdown" in environment_names()
    ep = env.start(EnvSample(0, "go", ""), seed=1)
    first = env.step(ep.state, ModelTurn(0, "ok", np.zeros(2, dtype=np.int32)))
    # the state alone carries the episode: a fresh environment continues it
    again = make_environment("countdown", turns=2)
    second = again.step(
        msgpack.unpackb(msgpack.packb(first.state)), ModelTurn(1, "no", np.zeros(2, np.int32))
    )
    assert (first.done, second.done) == (False, True)
    assert again.score(second.state) == 1.0


def test_registry_errors_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="register_environment"):
        make_environment("nope")
    with pytest.raises(ValueError, match="module:attribute"):
        register_environment("bad", "no_colon")
    monkeypatch.setitem(ENVIRONMENTS, "missing", "staleflow.envs.no_such_module:X")
    with pytest.raises(ImportError, match="could not be loaded"):
        make_environment("missing")
    monkeypatch.setitem(ENVIRONMENTS, "notenv", "builtins:dict")
    with pytest.raises(EnvContractError, match="lacks name, start, step or score"):
        make_environment("notenv")


def test_sample_and_step_are_frozen() -> None:
    s = EnvSample(1, "p", "a")
    assert replace(s, answer="b").answer == "b"
    with pytest.raises(AttributeError):
        s.answer = "c"  # type: ignore[misc]
