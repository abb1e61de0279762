"""The built-in reward functions and the registry."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from staleflow.data import ArithmeticTask
from staleflow.rewards import (
    REWARD_NAMES,
    RewardError,
    RewardFn,
    arithmetic,
    as_reward,
    exact,
    make_reward_fn,
    register_reward,
    resolve_reward_kind,
    reward_names,
    reward_spec,
)
from staleflow.rewards.mathverify import INSTALL_HINT, MathVerifyReward, require_math_verify


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("19", "19", 1.0),
        (" 19\n", "19", 1.0),
        ("12+7=19", "19", 1.0),  # shown work: the text after the last '='
        ("=19", "19", 1.0),
        ("-10", "-10", 1.0),
        ("12+7=19=20", "19", 0.0),
        ("19.0", "19", 0.0),
        ("19 apples", "19", 0.0),
        ("", "19", 0.0),
        ("1", "19", 0.0),
    ],
)
def test_arithmetic(response, answer, reward):
    assert arithmetic(response, answer) == reward


def test_arithmetic_accepts_every_answer_of_the_task():
    for p in ArithmeticTask().problems(50):
        assert arithmetic(p.answer, p.answer) == 1.0
        assert arithmetic(p.prompt + p.answer, p.answer) == 1.0


def test_exact():
    assert exact(" blue ", "blue") == 1.0
    assert exact("12+7=19", "19") == 0.0
    assert exact("Blue", "blue") == 0.0


def test_registry_builds_by_name():
    assert set(REWARD_NAMES) <= set(reward_names())
    assert make_reward_fn("arithmetic") is arithmetic
    assert make_reward_fn("exact") is exact
    assert isinstance(arithmetic, RewardFn)
    assert reward_spec("math_verify").may_hang and not reward_spec("exact").may_hang
    with pytest.raises(ValueError, match="unknown reward function 'nope'; use one of"):
        make_reward_fn("nope")


def test_register_a_custom_reward(monkeypatch):
    import staleflow.rewards.registry as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_reward("custom", "staleflow.rewards.simple:make_exact")
    assert make_reward_fn("custom") is exact
    with pytest.raises(ValueError, match="module:attr"):
        register_reward("bad", "no_colon")


def test_auto_resolves_by_task():
    assert resolve_reward_kind("auto", "arithmetic") == "arithmetic"
    for task in ("gsm8k", "dapo", "jsonl", "parquet"):
        assert resolve_reward_kind("auto", task) == "math_verify"
    assert resolve_reward_kind("exact", "gsm8k") == "exact"


@pytest.mark.parametrize(
    ("value", "reward"), [(1, 1.0), (0.5, 0.5), (True, 1.0), (np.float32(0.25), 0.25)]
)
def test_as_reward_accepts_finite_numbers(value, reward):
    assert as_reward(value) == reward and isinstance(as_reward(value), float)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (math.nan, "nan, not a finite number"),
        (math.inf, "inf, not a finite number"),
        (None, "returned NoneType None, not a number"),
        ("1.0", "returned str '1.0', not a number"),
    ],
)
def test_as_reward_rejects_junk(value, expected):
    with pytest.raises(RewardError, match=expected):
        as_reward(value)


def test_math_verify_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(
        ImportError, match=r"math-verify is missing.*-m pip install -c \S*constraints\.txt -e "
    ):
        require_math_verify()
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    with pytest.raises(ImportError) as err:
        MathVerifyReward()
    assert str(err.value) == INSTALL_HINT
