"""End to end on real Ray actors: the embedded engine, reward workers, trainer, TS, PS and
control plane, with a micro model (no warm-up) for a few steps.

What must hold whatever the policy learns: every consumed trajectory is within eta of
the buffer it trained (exactly on-policy at eta = 0); nothing is lost or consumed twice
between TS, instances, reward workers and trainer; instances load newer weights as the
PS advances; with redundant rollout on, the surplus is dropped and the late messages
about it (rewards, partials) are dropped too, not fatal.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.staleflow.runtime.driver.launch_checks import MICRO_RUN, check_run
from tests.staleflow.runtime.driver.user_inputs import (
    check_evaluation,
    check_user_inputs,
    heldout_file,
    hf_policy_and_dataset,
)

# A real run is a dozen processes: minutes on a loaded 2-core machine (over the suite's
# 300 s once at load 24). The timeout only stops a hang; nothing here is timed.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

STEPS = 4


def _launch(tmp_path, eta: int, *extra: str):
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    cfg = load_config(
        None,
        [
            f"eta={eta}",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            *MICRO_RUN,
            "dashboard=false",  # tests/staleflow/dashboard/test_launch_dashboard.py has it on
            "eval.problems=32",
            *extra,
        ],
    )
    return launch(cfg)


def _check_eval(result) -> None:
    # held-out rewards of the initial weights and of the final checkpoint
    summary = result.summary
    assert summary.eval_problems == 32
    assert summary.eval_reward_start is not None and 0.0 <= summary.eval_reward_start <= 1.0
    assert summary.eval_reward_end is not None and 0.0 <= summary.eval_reward_end <= 1.0


def test_launch_eta1_bounded_and_conserving(tmp_path):
    """Also the algorithm options end to end: GSPO with the KL to the initial policy (a
    second model in the trainer actor) and dynamic sampling hold the bound and the audit
    like the default. The untrained micro model's groups are nearly all wrong (rewards all
    0): dynamic sampling drops them up to its budget per step (max_drop 0.5: one batch of
    2) and trains on the rest, so every batch is still full."""
    result = _launch(
        tmp_path,
        1,
        "trainer.loss=gspo",
        "trainer.kl_coef=0.01",
        "trainer.dynamic_sampling=true",
        "trainer.dynamic_sampling_max_drop=0.5",
    )
    check_run(result, 1, STEPS, 2 * 4)  # full batches, the bound, the audit with filtered
    audit, summary = result.summary.audit, result.summary
    assert audit["filtered_groups"] > 0 and audit["filtered"] == 4 * audit["filtered_groups"]
    records = [r.extra for r in result.records]
    assert all(0 <= e["rollout/filtered_groups"] <= e["rollout/sampled_groups"] for e in records)
    assert all(0.0 <= e["rollout/filtered_frac"] <= 1.0 for e in records)
    # the records count what the control plane filtered up to the last step; the audit
    # also what it filtered between that step and the stop
    assert summary.filtered_groups is not None and summary.filtered_frac is not None
    assert 0 < summary.filtered_groups <= audit["filtered_groups"]
    assert 0.0 < summary.filtered_frac < 1.0
    _check_eval(result)
    ref_kl = [r.extra["train/ref_kl"] for r in result.records]
    assert len(ref_kl) == STEPS and all(k >= 0 for k in ref_kl)
    assert ref_kl[0] == 0.0  # the policy is its own reference at first
    # later, KL > 0 exactly when an update moved the policy (the micro model's groups are
    # often all wrong: no gradient, no move)
    moved = any(r.extra["train/grad_norm"] > 0 for r in result.records[:-1])
    assert (ref_kl[-1] > 0) == moved, (ref_kl, moved)


# Each other loss variant launched once with the KL on (each with its own estimator): a
# launch each (45-80 s on CI), so slow. In the default run, the eta = 1 launch above is
# GSPO with the KL; each variant's maths against hand-computed numbers is
# tests/staleflow/trainers/test_trainers_loss_variants.py, and the KL's
# test_trainers_reference.py (unit level, both trainers' shared code).
@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(("trainer.loss=ppo", "trainer.kl_estimator=k1"), id="ppo-k1"),
        pytest.param(
            ("trainer.loss=cispo", "trainer.eps_low=0.99", "trainer.kl_estimator=k2"),
            id="cispo-k2",
        ),
        pytest.param(("trainer.advantage=drgrpo", "trainer.kl_estimator=k3"), id="drgrpo-k3"),
    ],
)
def test_launch_each_loss_variant_with_the_kl_holds_the_bound_and_the_audit(tmp_path, variant):
    import yaml

    result = _launch(tmp_path, 1, "trainer.kl_coef=0.01", *variant)
    check_run(result, 1, STEPS, 2 * 4)
    ref_kl = [r.extra["train/ref_kl"] for r in result.records]
    assert len(ref_kl) == STEPS and all(k >= 0 for k in ref_kl) and ref_kl[0] == 0.0
    # the run trained what it was asked (config.yaml holds the resolved keys)
    trainer = yaml.safe_load((result.run_dir / "config.yaml").read_text())["trainer"]
    for key, value in (v.split("=") for v in variant):
        assert str(trainer[key.removeprefix("trainer.")]) == value, key
    if "trainer.advantage=drgrpo" in variant:  # Dr. GRPO's constant length L
        assert trainer["loss_norm_len"] == 8  # rollout.max_response_tokens


@pytest.mark.slow  # a launch (45-80 s on CI): CI's budget keeps two here; in-process tests cover it
def test_launch_eta0_is_exactly_on_policy(tmp_path):
    result = _launch(tmp_path, 0)
    check_run(result, 0, STEPS, 2 * 4)
    _check_eval(result)
    for step in result.consumed:
        # every token of every consumed trajectory came from the version being trained
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    assert result.summary.on_policy_tokens is True


def test_launch_with_streamed_training_is_exactly_on_policy_and_loses_nothing(tmp_path):
    """trainer.stream (RolloutPipe's complete-group pipelining) at eta = 0: the trainer
    reads each occupied group from the TS as it comes and takes the rest at the Consume.
    The audit trail writes each trajectory once, when its batch is taken. (That groups
    really are trained before the buffer is full is made to happen, and checked, in
    tests/staleflow/runtime/test_runtime_stream.py.)

    The same run also has what a user brings (docs/tracking.md), so that one launch
    covers it: its own Hugging Face checkpoint (the micro model with a character-level
    HF tokenizer carrying a chat template), a ``datasets`` save_to_disk folder with mapped
    columns rendered through the template with a system prompt, and all three trackers,
    each holding every step and the summary when the run ends. And its own held-out set
    (a JSON Lines file, the same columns and template), evaluated every 5 steps on the
    rollout engines: the record of step 5 holds it, the trackers and summary too, while
    the bound and the audit hold as without it (docs/evaluation.md)."""
    for extra in ("datasets", "tensorboard", "wandb", "mlflow"):  # the dev install has them
        pytest.importorskip(extra, reason="needs the tracking and datasets extras")
    policy, data = hf_policy_and_dataset(tmp_path / "inputs")
    steps = 5  # one evaluation, after the last step: the run waits for it
    result = _launch(
        tmp_path,
        0,
        f"steps={steps}",
        f"eval.path={heldout_file(tmp_path / 'inputs')}",
        "eval.every=5",
        "eval.samples=2",
        "eval.problems=8",
        "trainer.stream=true",
        "recovery.audit_log=true",
        f"model.checkpoint={policy}",
        "data.task=hf",
        f"data.path={data}",
        "data.prompt_column=problem",
        "data.answer_column=solution",
        "data.chat_template=true",
        "data.system_prompt=0",
        "tracking=tensorboard,wandb,mlflow",
    )
    check_run(result, 0, steps, 2 * 4)
    for step in result.consumed:
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    assert all(rec.streamed_groups is not None for rec in result.records)
    assert all(0 <= rec.streamed_groups <= 2 for rec in result.records)
    audit = (result.run_dir / "audit.jsonl").read_text().splitlines()
    assert len(audit) == steps * 2 * 4  # streamed groups are not written twice
    check_user_inputs(result, steps)
    check_evaluation(result, step=5, problems=8, samples=2)


@pytest.mark.slow  # a launch (45-80 s on CI): CI's budget keeps two here; in-process tests cover it
def test_launch_with_the_tail_race_is_exactly_on_policy_and_loses_nothing(tmp_path):
    """coordinator.race (SpecActor's fastest-of-N) at eta = 0, where the trainer waits for
    its buffer's last trajectories while instances that finished theirs idle at the same
    version: copies race the stragglers and complete them in their holder's name. (That
    copies win and change no token is made to happen, and checked, in
    tests/staleflow/runtime/controller/test_races_inprocess.py.)"""
    result = _launch(
        tmp_path,
        0,
        "coordinator.race.enabled=true",
        "recovery.audit_log=true",
        "rollout.max_response_tokens=48",  # long enough for a tail (a race now and then)
    )
    check_run(result, 0, STEPS, 2 * 4)
    for step in result.consumed:
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    last = result.records[-1].extra
    assert 0 <= last["race/won"] <= last["race/started"], last
    audit = (result.run_dir / "audit.jsonl").read_text().splitlines()
    assert len(audit) == STEPS * 2 * 4  # a raced trajectory is trained once
    print("races:", {k: v for k, v in last.items() if k.startswith("race/")})


@pytest.mark.slow  # a launch (45-80 s on CI): CI's budget keeps two here; in-process tests cover it
def test_launch_with_batch_and_group_redundancy_drops_the_surplus(tmp_path):
    """§4.3 / App. C: 3 entries per buffer of 2 groups, 5 members per group of 4. This used
    to stop with ``TrajectoryGone`` as soon as a dropped trajectory's reward came in."""
    result = _launch(tmp_path, 2, "group_redundancy=0.25", "batch_redundancy=0.5")
    check_run(result, 2, STEPS, 2 * 4)  # redundancy trains batch x group all the same
    _check_eval(result)
    # every consumed group ran 5 members and trained on 4: the fifth was dropped
    assert result.summary.audit["aborted"] >= STEPS * 2


@pytest.mark.slow  # a launch (45-80 s on CI): CI's budget keeps two here; in-process tests cover it
def test_a_dead_rollout_actor_is_restarted_and_instances_join_and_leave(tmp_path):
    """docs/recovery.md. A killed instance: the control plane gives its trajectories back
    to the TS, the supervisor starts a new incarnation (its own holder id) and the run
    goes on. Elastic rollout through ``staleflow scale``'s request: a third instance
    joins, Pulls the current version and is routed to; then two leave, their
    trajectories back in the TS, and the run goes on with one. Each is in the records."""
    import threading

    import ray

    from staleflow.config import load_config
    from staleflow.runtime.driver.elastic import request_scale
    from staleflow.runtime.driver.launch import Run, build_dataset, prepare_policy
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.driver.supervisor import Supervisor

    plan = plan_run(load_config(None, ["eta=1", f"run_dir={tmp_path}", *MICRO_RUN]))
    model, tokenizer, _ = prepare_policy(plan.model, plan.task)
    run = Run(plan, tmp_path, supervisor=Supervisor)
    records: list[dict[str, float]] = []
    stop = threading.Event()
    phase = {"name": "grow", "at": 0}
    left: dict[int, str] = {}

    def elastic(record: Any) -> None:  # a StepRecord; its flat form names instances' keys
        rec = record.to_flat()
        records.append(rec)
        step = int(rec["step"])
        if phase["name"] == "grow" and step >= 1:
            assert "asked for 3" in request_scale(str(tmp_path), instances=3)
            phase["name"] = "joining"
        elif phase["name"] == "joining" and "rollout/version/2" in rec:
            new = run.rollout.actors[2]
            if ray.get(new.times.remote()).decode_tokens > 0:  # routed to, generating
                left.update({i: run.rollout.holders[i] for i in (1, 2)})
                assert "asked for 1" in request_scale(str(tmp_path), remove=2)
                phase["name"] = "shrinking"
        elif phase["name"] == "shrinking" and not any(f"rollout/version/{i}" in rec for i in left):
            phase.update(name="done", at=step)
        elif phase["name"] == "done" and step >= phase["at"] + 2:
            stop.set()  # two steps on one instance

    try:
        run.start(model, tokenizer, build_dataset(plan.task, tokenizer))
        first = run.rollout.holders[0]
        ray.kill(run.actors["instances"][0])
        deadline = time.monotonic() + 180
        while run.rollout.holders[0] == first or 0 in run.supervisor.pending:
            assert time.monotonic() < deadline, "instance 0 was not restarted"
            run.supervisor.tick()  # what train() does between its looks
            time.sleep(0.1)
        # no step budget: a step of the micro model takes ~0.1 s, a new instance's start
        # (a process, torch, the engine, its Pull) over a minute on a loaded machine; the
        # run stops itself two steps after the last phase (pytest's timeout stops a hang)
        run.train(1_000_000, on_record=elastic, stop=stop)
        assert phase["name"] == "done" and stop.is_set(), phase
        for holder in left.values():  # what they held went back to the TS
            assert run.control.ts.routed_to(holder) == ()
        members = run.control.driver.members()
    finally:
        run.shutdown()
    assert run.rollout is None and sorted(members) == [0]
    last = records[-1]
    assert last["recovery/instance_lost"] >= 1 and last["recovery/instance_restarted"] >= 1
    assert last["recovery/instance_added"] == 1 and last["recovery/instance_removed"] == 2


@pytest.mark.slow  # a launch (45-80 s on CI): CI's budget keeps two here; in-process tests cover it
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


@pytest.mark.slow  # a launch (45-80 s on CI): CI's budget keeps two here; in-process tests cover it
def test_a_ps_worker_that_dies_under_its_live_actor_is_replaced(tmp_path):
    """docs/recovery.md. The PS replica's worker process (the child of its actor that holds
    the weights) is SIGKILLed once the actors are up, before the first step, while the
    actor lives on. The actor says so when the supervisor asks; the replica is started
    again and refilled by the trainer. At eta = 1 the run cannot reach step 8 without it
    (the instances hold version 0), and it does, the replica at the last version."""
    import json
    import os
    import signal
    from pathlib import Path

    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    killed: list[int] = []

    def kill_worker(run: Any) -> None:  # on_started: the actors are up, no step taken yet
        actor = json.loads((run.run_dir / "live.json").read_text())["pids"]["ps/0"]
        children = Path(f"/proc/{actor}/task/{actor}/children").read_text().split()
        for pid in map(int, children):  # the worker, not multiprocessing's resource tracker
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    steps = 8
    settings = [f"steps={steps}", f"run_dir={tmp_path}", "dashboard=false", "eval.problems=0"]
    cfg = load_config(None, ["eta=1", *MICRO_RUN, *settings])
    result = launch(cfg, on_started=kill_worker)
    assert len(killed) == 1
    check_run(result, 1, steps, 2 * 4)  # the restarted replica holds version 8
    assert result.summary.audit["recovery"]["ps_restarted"] == 1
