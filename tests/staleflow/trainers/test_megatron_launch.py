"""``staleflow launch trainer.backend=megatron`` end to end on real Ray actors (CPU, gloo),
and the settings that must stop it before training.

The pool trains the built-in ``tiny`` policy (2 KV heads, so TP = 2 splits them) with two
Megatron ranks; rollout instances Pull the versions the ranks Push. What must hold is what
holds for the embedded trainer: every consumed trajectory within eta, nothing lost or
consumed twice, instances moving to newer versions, a loadable final checkpoint.
"""

from __future__ import annotations

import pytest

from tests.staleflow.runtime.driver.launch_checks import MICRO_RUN, check_run

pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

STEPS = 3
POOL = "staleflow.io/pool"


def _check_backends(cfg) -> None:
    """``check_backends`` with the sections ``launch`` hands it from the run plan."""
    from staleflow.runtime.backends import check_backends

    check_backends(cfg.rollout, cfg.trainer, cfg.model, cfg.recovery, address=cfg.address)


def _config(tmp_path, *extra: str):
    from staleflow.config import load_config

    return load_config(
        None,
        [
            "eta=3",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            "model.preset=tiny",
            "model.warmup=false",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=8",
            "coordinator.period_s=0.05",
            "dashboard=false",
            "eval_problems=0",
            "trainer.backend=megatron",
            *extra,
        ],
    )


@pytest.mark.slow  # a Megatron launch (70-130 s on CI): the dp2 streamed launch stays in the default run
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_launch_megatron_tp2_is_bounded_conserving_and_advancing(tmp_path):
    from staleflow.models.checkpoint import load_pretrained
    from staleflow.runtime.driver.launch import launch

    result = launch(_config(tmp_path, "trainer.tp=2"))
    # bound held, nothing lost or consumed twice, versions advancing, every PS replica at
    # the last version, a loadable checkpoint
    check_run(result, eta=3, steps=STEPS, trajectories_per_step=2 * 4)
    for rec in result.records:
        assert rec.tokens and rec.tokens > 0 and "train/push_wait_s" in rec.extra
    # the two ranks ran in the trainer gang's two bundles and each Pushed its own shard
    placement = result.summary.placement
    (gang,) = [g for g in placement["gangs"] if g["name"] == "trainer"]
    assert list(gang["members"]) == ["trainer/0", "trainer/1"]
    assert {p["sender"] for p in placement["weights"]["push"]} == {"trainer/0", "trainer/1"}
    # the final checkpoint: an HF folder and, inside, the distributed checkpoint
    model, _ = load_pretrained(result.run_dir / "checkpoint")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_key_value_heads == 2
    assert (result.run_dir / "checkpoint" / "megatron" / "common.pt").is_file()
    # a new run at TP = 1 starts from that checkpoint: the HF folder for rollout, the
    # distributed one (written at TP = 2) for the trainer's weights and AdamW state
    ckpt = result.run_dir / "checkpoint"
    resumed = launch(
        _config(
            tmp_path, f"model.checkpoint={ckpt}", f"trainer.load={ckpt / 'megatron'}", "steps=2"
        )
    )
    assert len(resumed.records) == 2
    assert all(rec.tokens and rec.tokens > 0 for rec in resumed.records)
    assert set(resumed.summary.audit["ps_latest"].values()) == {2}


@pytest.mark.slow  # a Megatron launch (56 s); real ranks step in test_megatron_{equivalence,pipeline,mask}
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_launch_megatron_dp2_streamed_is_on_policy_and_conserving(tmp_path):
    """trainer.stream on the pool at eta = 0: each occupied group goes to a data leader as
    it comes (read from the TS), the step takes the batch whole and trains the rest.
    (That the streamed step equals the whole batch's is test_megatron_equivalence.py's.)"""
    from staleflow.runtime.driver.launch import launch

    result = launch(_config(tmp_path, "trainer.dp=2", "trainer.stream=true", "eta=0"))
    check_run(result, eta=0, steps=STEPS, trajectories_per_step=2 * 4)
    for step in result.consumed:
        assert set(step["staleness"]) == {0} and set(step["token_staleness"]) == {0}
    assert all(rec.streamed_groups is not None for rec in result.records)
    assert all(rec.tokens and rec.tokens > 0 for rec in result.records)


@pytest.mark.slow  # a Megatron launch (70-130 s on CI): the dp2 streamed launch stays in the default run
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_launch_megatron_pp2_is_bounded_conserving_and_advancing(tmp_path):
    """Two pipeline stages of two layers each: the first stage's rank takes the groups
    from the TS, both Push their own layers, the PS serves every version whole."""
    from staleflow.models.checkpoint import load_pretrained
    from staleflow.runtime.driver.launch import launch

    result = launch(_config(tmp_path, "trainer.pp=2", "steps=2"))
    check_run(result, eta=3, steps=2, trajectories_per_step=2 * 4)
    assert all(rec.tokens and rec.tokens > 0 for rec in result.records)
    push = result.summary.placement["weights"]["push"]
    assert {p["sender"] for p in push} == {"trainer/0", "trainer/1"}
    assert all(p["bytes"] > 0 for p in push)
    assert set(result.summary.audit["ps_latest"].values()) == {2}
    model, _ = load_pretrained(result.run_dir / "checkpoint")
    assert model.config.num_hidden_layers == 4


@pytest.mark.slow  # a Megatron launch (70-130 s on CI): the dp2 streamed launch stays in the default run
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_a_lost_ps_replica_is_refilled_by_the_ranks_and_the_run_goes_on(tmp_path):
    """The only PS replica's process is killed after step 2 (SIGKILL: no goodbye). The
    ranks go on Pushing to no replica, and with eta = 1 the instances, which cannot Pull,
    soon fall too stale to be admitted (step 8 needs trajectories of version 6 or newer;
    the replica died at version 4 at most): the run cannot finish unless the supervisor
    starts the replica again (empty, at a new endpoint) while it trains, and both TP ranks
    connect to it and Push it their shards of the current version between two steps. It
    trains on to its step count, every bound holding, the replica at the last version."""
    import json
    import os
    import signal

    from staleflow.runtime.driver.launch import launch

    steps, killed = 8, []

    def kill_ps(rec) -> None:  # a StepRecord
        if rec.step == 2 and not killed:
            (live,) = tmp_path.glob("*/live.json")
            pid = json.loads(live.read_text())["pids"]["ps/0"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    cfg = _config(tmp_path, "trainer.tp=2", f"steps={steps}", "eta=1")
    result = launch(cfg, on_record=kill_ps)
    assert killed
    check_run(result, eta=1, steps=steps, trajectories_per_step=2 * 4)  # ps/0 at v8 too
    audit = result.summary.audit
    assert audit["recovery"]["ps_lost"] == audit["recovery"]["ps_restarted"] == 1, audit


@pytest.fixture
def two_rollout_nodes():
    """A Ray cluster of three raylets on this machine: the head (control, TS, reward) and
    two rollout nodes (one GPU token each, so one instance and one PS replica each); the
    first also hosts the trainer ranks."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 3,
            "resources": {"staleflow_head": 1},
            "_system_config": {"worker_niceness": 0},  # as deploy/ starts Ray
        },
    )
    a = c.add_node(
        num_cpus=4, num_gpus=1, labels={POOL: "rollout"}, resources={"staleflow_trainer": 1}
    )
    b = c.add_node(num_cpus=2, num_gpus=1, labels={POOL: "rollout"})
    c.wait_for_nodes()
    try:
        yield c, a.node_id, b.node_id
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.mark.slow  # a Megatron launch (70-130 s on CI): the dp2 streamed launch stays in the default run
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_every_rank_pushes_to_every_ps_replica(two_rollout_nodes, tmp_path):
    """Two PS replicas (one per rollout node, App. A.1), two data-parallel ranks: each
    rank sends each replica the pieces of the sharded-Push plan, and both replicas serve
    every version whole, so the instances on both nodes Pull the ranks' weights."""
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    c, node_a, node_b = two_rollout_nodes
    cfg = load_config(
        None,
        [
            "steps=3",
            "eta=1",
            *MICRO_RUN,
            "dashboard=false",
            "eval_problems=0",
            "trainer.backend=megatron",
            "trainer.dp=2",
            "rollout.instances=2",
            "resources.rollout.gpus=1",
            f"resources.rollout.node_label={POOL}=rollout",
            "resources.trainer.node_resource=staleflow_trainer",
            "resources.control.node_resource=staleflow_head",
            "resources.reward.node_resource=staleflow_head",
            "resources.parameter_server.cpus=0.5",
            f"address={c.address}",
            f"run_dir={tmp_path}",
        ],
    )
    result = launch(cfg)
    check_run(result, eta=1, steps=3, trajectories_per_step=2 * 4)  # both replicas at v3
    placement = result.summary.placement
    planned = {role: n for g in placement["gangs"] for role, n in g["members"].items()}
    replicas = {role: n for role, n in planned.items() if role.startswith("ps/")}
    assert sorted(replicas.values()) == sorted([node_a, node_b])
    assert planned["trainer/0"] == planned["trainer/1"] == node_a
    assert set(result.summary.audit["ps_latest"]) == set(replicas)
    push = placement["weights"]["push"]
    assert {(p["sender"], p["replica"]) for p in push} == {
        (rank, replica) for rank in ("trainer/0", "trainer/1") for replica in replicas
    }
    # each replica gets the whole model once, split between the two ranks
    per_replica = {r: sum(p["bytes"] for p in push if p["replica"] == r) for r in replicas}
    assert len(set(per_replica.values())) == 1, per_replica
    assert all(0 < p["bytes"] < next(iter(per_replica.values())) for p in push), push


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["trainer.tp=3"], r"trainer.tp=3 does not divide the model's 4 attention heads, 2 KV"),
        (["model.preset=micro", "trainer.tp=2"], r"use trainer.tp in \[1\]"),
        (["trainer.pp=3"], r"trainer.pp=3 does not divide the model's 4 layers .* \[1, 2, 4\]"),
    ],
)
def test_settings_the_model_cannot_run_stop_launch_before_anything_slow(
    tmp_path, monkeypatch, extra, match
):
    from staleflow.runtime.driver import launch as launching
    from staleflow.runtime.driver.launch import LaunchError

    def never(*args, **kwargs):
        raise AssertionError("the cluster was joined for a trainer that cannot run")

    monkeypatch.setattr(launching, "place", never)
    with pytest.raises(LaunchError, match=match):
        launching.launch(_config(tmp_path, *extra))
    assert not any(tmp_path.iterdir()), "refused before the run folder is made"


def test_a_checkpoint_of_another_architecture_stops_launch(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from staleflow.runtime.driver.launch import LaunchError

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=17))
    gpt2.save_pretrained(tmp_path / "gpt2")
    cfg = _config(tmp_path, f"model.checkpoint={tmp_path / 'gpt2'}")
    with pytest.raises(LaunchError, match=r"model_type 'gpt2' .* or trainer.backend=embedded"):
        _check_backends(cfg)


def test_an_audit_log_is_refused_for_the_megatron_pool(tmp_path):
    """``recovery.audit_log`` is the embedded trainer's (it sees every batch): asked of a
    Megatron run it is refused by name before anything starts, not silently left empty."""
    from staleflow.runtime.driver.launch import LaunchError

    with pytest.raises(LaunchError, match=r"recovery\.audit_log=false"):
        _check_backends(_config(tmp_path, "recovery.audit_log=true"))


def test_megatron_core_missing_stops_launch(tmp_path, monkeypatch):
    import importlib.util

    from staleflow.runtime.driver.launch import LaunchError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name, *a),
    )
    with pytest.raises(
        LaunchError, match=r"megatron-core is missing.*-m pip install .*\[megatron\]"
    ):
        _check_backends(_config(tmp_path))


def test_the_trainer_gang_has_a_bundle_per_rank_and_too_few_gpus_are_refused(tmp_path):
    """Each rank asks ``resources.trainer.gpus`` in its own bundle; a cluster with fewer
    GPUs than the ranks ask is refused by the placement fit, naming the trainer gang."""
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.errors import PlacementError
    from staleflow.runtime.placement.fitting import Node, fit

    cfg = _config(tmp_path, "trainer.tp=2", "trainer.dp=2", "resources.trainer.gpus=1")
    plan = plan_run(cfg).placement.plan  # ranks: the backend's dp x tp x pp
    (gang,) = plan.pool("trainer")
    assert gang.roles == ("trainer/0", "trainer/1", "trainer/2", "trainer/3")
    assert gang.bundle.gpus == 1
    fit(plan, [Node("a", "", {"CPU": 16, "GPU": 4})])
    with pytest.raises(PlacementError, match=r"trainer needs .*GPU 1"):
        fit(plan, [Node("a", "", {"CPU": 16, "GPU": 2})])


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(3600)
def test_the_default_run_learns_with_the_megatron_trainer(tmp_path):
    """``staleflow launch --eta 3 trainer.backend=megatron trainer.tp=2`` on the built-in
    task: the same bar as the embedded trainer's learning test
    (tests/staleflow/runtime/driver/test_launch_learning.py)."""
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch, reward_mean

    cfg = load_config(
        None,
        [
            "eta=3",
            f"run_dir={tmp_path}",
            "eval_problems=1024",
            "trainer.backend=megatron",
            "trainer.tp=2",
        ],
    )
    result = launch(cfg)
    s = result.summary
    assert s.eval_reward_end is not None and s.eval_reward_start is not None, s
    assert s.eval_reward_end > s.eval_reward_start + 0.04, s
    first, last = reward_mean(result.records[:50]), reward_mean(result.records[-50:])
    assert first is not None and last is not None
    assert last > first + 0.03, (first, last)


@pytest.mark.slow  # a Megatron launch (70-130 s on CI): the dp2 streamed launch stays in the default run
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_a_stopped_megatron_run_resumes_from_its_run_checkpoint(tmp_path):
    """The run checkpoint of a Megatron pool holds the ranks' distributed checkpoint
    (weights, AdamW state, version) and RNG state beside the HF folder; ``--resume``
    loads them: the pool goes on from the checkpoint's version, AdamW's step count goes on
    (it was restored, not restarted), and no trajectory is trained twice."""
    import threading
    from collections import Counter

    from megatron.core import dist_checkpointing

    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch
    from staleflow.runtime.driver.resume import check_resume
    from staleflow.trainers.megatron.checkpoint import read_meta

    eta, stop_at, more = 1, 2, 2
    cfg = load_config(
        None,
        [
            f"eta={eta}",
            "steps=100000",
            f"run_dir={tmp_path}",
            *MICRO_RUN,
            "dashboard=false",
            "eval_problems=0",
            "trainer.backend=megatron",
        ],
    )
    stop = threading.Event()
    first = launch(
        cfg, on_record=lambda rec: stop.set() if rec.step >= stop_at else None, stop=stop
    )
    assert first.stopped and first.checkpoint is not None
    k = len(first.records)
    trainer = first.checkpoint / "trainer"
    assert read_meta(trainer / "megatron")["version"] == k
    assert (trainer / "rng" / "rank-0.pt").is_file()
    assert (trainer / "model.safetensors").is_file()  # the PS and the engines start from it

    resumed_cfg, ck = check_resume(first.run_dir, [f"steps={k + more}"])
    second = launch(resumed_cfg, resume=ck)
    assert not second.stopped
    assert [r.step for r in second.records] == list(range(1, k + more + 1))
    assert [s["version"] for s in second.consumed] == list(range(k, k + more))
    ids: Counter[int] = Counter()
    for step in first.consumed + second.consumed:
        assert min(step["staleness"]) >= 0 and max(step["staleness"]) <= eta
        ids.update(step["traj_ids"])
    assert max(ids.values()) == 1, "a trajectory was trained on twice across the resume"
    assert set(second.summary.audit["ps_latest"].values()) == {k + more}
    # the final distributed checkpoint: version and AdamW steps both count every step
    final = second.checkpoint / "trainer" / "megatron"
    assert read_meta(final)["version"] == k + more
    common = dist_checkpointing.load_common_state_dict(str(final))
    assert common["optimizer"]["adam_step"] == k + more
