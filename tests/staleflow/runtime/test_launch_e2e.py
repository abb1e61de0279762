"""End to end on real Ray actors: the embedded engine, reward workers, trainer, TS, PS and
control plane, with a micro model (no warm-up) for a few steps.

What must hold whatever the policy learns: every consumed trajectory is within eta of
the buffer it trained (exactly on-policy at eta = 0); nothing is lost or consumed twice
between TS, instances, reward workers and trainer; instances load newer weights as the
PS advances; with redundant rollout on, the surplus is dropped and the late messages
about it (rewards, partials) are dropped too, not fatal.
"""

from __future__ import annotations

import pytest

from tests.staleflow.runtime.launch_checks import MICRO_RUN, check_run

# A real run is a dozen processes: minutes on a loaded 2-core machine (over the suite's
# 300 s once at load 24). The timeout only stops a hang; nothing here is timed.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

STEPS = 4


def _launch(tmp_path, eta: int, *extra: str):
    from staleflow.config import load_config
    from staleflow.runtime.launch import launch

    cfg = load_config(
        None,
        [
            f"eta={eta}",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            *MICRO_RUN,
            "dashboard=false",  # tests/staleflow/dashboard/test_launch_dashboard.py has it on
            "eval_problems=32",
            *extra,
        ],
    )
    return launch(cfg)


def _check_eval(result) -> None:
    # held-out rewards of the initial weights and of the final checkpoint
    summary = result.summary
    assert summary["eval_problems"] == 32
    assert 0.0 <= summary["eval_reward_start"] <= 1.0
    assert 0.0 <= summary["eval_reward_end"] <= 1.0


def test_launch_eta1_bounded_and_conserving(tmp_path):
    result = _launch(tmp_path, 1)
    check_run(result, 1, STEPS, 2 * 4)
    _check_eval(result)


def test_launch_eta0_is_exactly_on_policy(tmp_path):
    result = _launch(tmp_path, 0)
    check_run(result, 0, STEPS, 2 * 4)
    _check_eval(result)
    for step in result.consumed:
        # every token of every consumed trajectory came from the version being trained
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    assert result.summary["on_policy_tokens"] is True


def test_launch_with_batch_and_group_redundancy_drops_the_surplus(tmp_path):
    """§4.3 / App. C: 3 entries per buffer of 2 groups, 5 members per group of 4. This used
    to stop with ``TrajectoryGone`` as soon as a dropped trajectory's reward came in."""
    result = _launch(tmp_path, 2, "group_redundancy=0.25", "batch_redundancy=0.5")
    check_run(result, 2, STEPS, 2 * 4)  # redundancy trains batch x group all the same
    _check_eval(result)
    # every consumed group ran 5 members and trained on 4: the fifth was dropped
    assert result.summary["audit"]["aborted"] >= STEPS * 2


def test_a_dead_rollout_actor_stops_the_run_with_a_clear_error(tmp_path):
    import ray

    from staleflow.config import load_config
    from staleflow.runtime.launch import LaunchError, Run, build_dataset, prepare_policy

    cfg = load_config(
        None,
        [
            "eta=1",
            f"run_dir={tmp_path}",
            "model.preset=micro",
            "model.warmup=false",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=8",
        ],
    )
    model, tokenizer, _ = prepare_policy(cfg)
    run = Run(cfg, tmp_path)
    try:
        run.start(model, tokenizer, build_dataset(cfg, tokenizer))
        ray.kill(run.actors["instances"][0])
        with pytest.raises(LaunchError, match="stopped"):
            run.train(50, on_record=lambda rec: None)
    finally:
        run.shutdown()


def test_launch_with_seer_divided_rollout_holds_the_bound_and_loses_nothing(tmp_path):
    """coordinator.seer on: 8-token responses in chunks of 3, re-placed between chunks,
    probes first and longest-estimated groups next (coordinator/seer.py)."""
    result = _launch(
        tmp_path, 1, "coordinator.seer.enabled=true", "coordinator.seer.chunk_tokens=3"
    )
    check_run(result, 1, STEPS, 2 * 4)
    for step in result.consumed:  # every token within eta of the buffer it trained
        assert max(step["token_staleness"]) <= 1, step
    last = result.records[-1]
    assert last.chunks is not None and last.chunks > 0  # chunks ended and were re-placed
    assert last.probe_error is None or 0.0 <= last.probe_error < 1.0
