"""``staleflow launch`` with ``rollout.backend=vllm`` end to end on CPU: real Ray actors, real
vLLM engines (one per instance) loading the built-in policy from the run folder and every
new version from the parameter server, the embedded trainer.

What must hold whatever the policy learns (as for the embedded engine in
tests/staleflow/runtime/test_launch_e2e.py): every consumed group within eta (exactly
on-policy at eta = 0), nothing lost or consumed twice (the run's audit), instances loading
the versions the PS publishes. Runs in CI's vLLM stage (.ci/vllm).
"""

from __future__ import annotations

import pytest

from tests.staleflow.engines.backends import VLLM_SKIP, vllm_available
from tests.staleflow.runtime.launch_checks import check_run
from tests.staleflow.runtime.test_launch_e2e import STEPS

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(not vllm_available(), reason=VLLM_SKIP),
]


def _launch(tmp_path, eta: int, *extra: str):
    from staleflow.config import load_config
    from staleflow.runtime.launch import launch

    cfg = load_config(
        None,
        [
            f"eta={eta}",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            "model.preset=tiny",  # head size 64: vLLM's CPU attention has no 16 (micro)
            "model.warmup=false",
            "rollout.backend=vllm",
            "rollout.instances=2",
            "rollout.kv_budget_tokens=2048",
            "rollout.max_running=16",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=8",
            "coordinator.period_s=0.05",
            "dashboard=false",
            "eval_problems=32",
            *extra,
        ],
    )
    return launch(cfg)


def _check_run(result, eta: int) -> None:
    check_run(result, eta, STEPS, 2 * 4)  # the embedded engine's end-to-end checks
    # the engines loaded the built-in policy the launch saved into the run folder
    assert (result.run_dir / "engine_model" / "config.json").is_file()


def test_launch_vllm_eta3_bounded_and_conserving(tmp_path):
    _check_run(_launch(tmp_path, 3), 3)


def test_launch_vllm_eta0_is_exactly_on_policy(tmp_path):
    result = _launch(tmp_path, 0)
    _check_run(result, 0)
    for step in result.consumed:
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    assert result.summary["on_policy_tokens"] is True


def test_launch_vllm_with_the_tail_race_is_exactly_on_policy(tmp_path):
    """coordinator.race on vLLM: a copy forks from the response the TS has (vLLM draws
    by position, as the embedded engine; runtime/races.py), completes in its holder's
    name, and the run keeps the bound and loses nothing."""
    result = _launch(tmp_path, 0, "coordinator.race.enabled=true", "rollout.max_response_tokens=32")
    _check_run(result, 0)
    for step in result.consumed:
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    last = result.records[-1].extra
    assert 0 <= last["race/won"] <= last["race/started"], last
    print("races:", {k: v for k, v in last.items() if k.startswith("race/")})


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_launch_vllm_raises_the_mean_reward(tmp_path):
    """The default run (warmed built-in policy, 200 steps of 32 x 8) with vLLM rolling out
    learns as the embedded one does (tests/staleflow/runtime/test_launch_learning.py, same
    thresholds). Slow: run it with ``pytest -m "vllm and slow"`` in the vLLM environment."""
    from staleflow.config import load_config
    from staleflow.runtime.launch import launch, reward_mean

    cfg = load_config(
        None, ["eta=3", f"run_dir={tmp_path}", "eval_problems=1024", "rollout.backend=vllm"]
    )
    result = launch(cfg)
    s = result.summary
    assert s["eval_reward_end"] > s["eval_reward_start"] + 0.04, s
    first, last = reward_mean(result.records[:50]), reward_mean(result.records[-50:])
    assert first is not None and last is not None
    assert last > first + 0.03, (first, last)
