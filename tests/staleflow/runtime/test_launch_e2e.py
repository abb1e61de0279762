"""End to end on real Ray actors: the embedded engine, reward workers, trainer, TS, PS and
control plane, with a micro model (no warm-up) for a few steps.

What must hold whatever the policy learns: every consumed trajectory is within eta of
the buffer it trained (exactly on-policy at eta = 0); nothing is lost or consumed twice
between TS, instances, reward workers and trainer; instances load newer weights as the
PS advances.
"""

from __future__ import annotations

from collections import Counter

import pytest

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
            "model.preset=micro",
            "model.warmup=false",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=8",
            "coordinator.period_s=0.05",
            "dashboard=false",  # tests/staleflow/dashboard/test_launch_dashboard.py has it on
            "eval_problems=32",
            *extra,
        ],
    )
    return launch(cfg)


def _check_run(result, eta: int) -> None:
    from staleflow.runtime.record import read_records

    assert len(result.records) == STEPS
    ids: Counter[int] = Counter()
    for step in result.consumed:
        assert max(step["staleness"]) <= eta, step
        assert min(step["staleness"]) >= 0
        ids.update(step["traj_ids"])
        assert len(step["traj_ids"]) == 2 * 4  # batch x group, no redundancy
    assert ids and max(ids.values()) == 1, "a trajectory was consumed twice"
    audit = result.summary["audit"]
    assert audit["routed"] == 0 and audit["on_instances"] == 0, audit
    assert audit["consumed"] == sum(ids.values())
    assert audit["created"] == (
        audit["consumed"] + audit["aborted"] + audit["queued"] + audit["completed"]
    ), audit
    # instances moved to newer weights as the PS advanced
    versions = [max(rec.instance_version.values()) for rec in result.records]
    assert versions == sorted(versions), versions  # an instance never loads older weights
    # the last batch (version STEPS - 1) admits nothing older than STEPS - 1 - eta, so some
    # instance must have loaded at least that version from the PS before the step's record
    assert versions[-1] >= max(1, STEPS - 1 - eta), versions
    # metrics.jsonl holds exactly the records the run streamed
    assert read_records(result.run_dir / "metrics.jsonl") == result.records
    assert (result.run_dir / "config.yaml").is_file()
    # the checkpoint is a complete policy: model.checkpoint=<it> resumes from it
    from staleflow.models.checkpoint import load_pretrained

    model, tokenizer = load_pretrained(result.run_dir / "checkpoint")
    assert tokenizer.decode(tokenizer.encode("12+7=")) == "12+7="
    assert sum(p.numel() for p in model.parameters()) > 0
    # held-out rewards of the initial weights and of the final checkpoint
    summary = result.summary
    assert summary["eval_problems"] == 32
    assert 0.0 <= summary["eval_reward_start"] <= 1.0
    assert 0.0 <= summary["eval_reward_end"] <= 1.0


def test_launch_eta1_bounded_and_conserving(tmp_path):
    result = _launch(tmp_path, 1)
    _check_run(result, 1)


def test_launch_eta0_is_exactly_on_policy(tmp_path):
    result = _launch(tmp_path, 0)
    _check_run(result, 0)
    for step in result.consumed:
        # every token of every consumed trajectory came from the version being trained
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    assert result.summary["on_policy_tokens"] is True


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
