"""The held-out evaluation of the calculator task: its problems are held out from the
run's own, and its score is the share of episodes that the environment scores solved,
played turn by turn with the policy (no Ray, no launch)."""

from __future__ import annotations

import pytest

from staleflow.config import load_config
from staleflow.envs.calculator import calculator_tokenizer
from staleflow.runtime.driver.env_task import calculator_heldout, task_environment, task_samples
from staleflow.runtime.driver.evaluation import check_heldout, held_out_reward, held_out_success
from staleflow.runtime.driver.run_plan import plan_run
from tests.support.scripted_policy import ScriptedPolicy, never_calls, solves


def _plan(*overrides: str):  # type: ignore[no-untyped-def]
    return plan_run(load_config(None, ["data.task=calculator", "eval.problems=8", *overrides]))


def test_the_held_out_problems_are_none_of_the_runs_own_and_seeded() -> None:
    plan = _plan()
    held = calculator_heldout(plan.task, 300)
    trained = {s.prompt for s in task_samples(plan.task, task_environment(plan.task))}
    assert len(held) == 300
    assert not {s.prompt for s in held} & trained
    assert [s.sample_id for s in held] == list(range(300))
    assert [s.prompt for s in held] == [s.prompt for s in calculator_heldout(plan.task, 300)]
    other = calculator_heldout(_plan("seed=5").task, 300)
    assert [s.prompt for s in other] != [s.prompt for s in held]  # the run's seed draws them


def test_a_level_without_a_held_out_problem_is_refused_with_the_fix() -> None:
    from staleflow.runtime.errors import LaunchError

    # level 1: two one-digit operands, 200 problems, all among the run's 20,000 samples
    plan = _plan("data.difficulty=1")
    with pytest.raises(LaunchError, match=r"eval.problems=0 or a higher data.difficulty"):
        calculator_heldout(plan.task, 8)
    with pytest.raises(LaunchError, match=r"eval.problems=0 or a higher data.difficulty"):
        check_heldout(plan.task)  # in the launcher's preflight, before the warm-up
    check_heldout(_plan("data.difficulty=1", "eval.problems=0").task)  # nothing held out
    check_heldout(_plan().task)


@pytest.mark.parametrize(("rule", "expected"), [(solves, 1.0), (never_calls, 0.0)])
def test_the_score_is_the_share_of_episodes_the_environment_scores_solved(
    rule, expected: float
) -> None:  # type: ignore[no-untyped-def]
    plan = _plan()
    policy = ScriptedPolicy(calculator_tokenizer(), rule)
    score = held_out_success(plan.task, plan.rollout, policy, calculator_tokenizer())
    assert score == expected
    # the solver needs two turns (the call, then the answer), the other one
    assert policy.calls >= (2 if rule is solves else 1)
    assert policy.training  # left as it was found


def test_held_out_reward_plays_the_calculators_episodes_unless_told_not_to() -> None:
    tok = calculator_tokenizer()
    plan = _plan()
    assert held_out_reward(plan.task, plan.rollout, ScriptedPolicy(tok, solves), tok) == 1.0
    none = _plan("eval.problems=0")
    assert held_out_reward(none.task, none.rollout, ScriptedPolicy(tok, solves), tok) is None
