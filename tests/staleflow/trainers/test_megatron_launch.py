"""``staleflow launch trainer.backend=megatron`` end to end on real Ray actors (CPU, gloo),
and the settings that must stop it before training.

The pool trains the built-in ``tiny`` policy (2 KV heads, so TP = 2 splits them) with two
Megatron ranks; rollout instances Pull the versions the ranks Push. What must hold is what
holds for the embedded trainer: every consumed trajectory within eta, nothing lost or
consumed twice, instances moving to newer versions, a loadable final checkpoint.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

STEPS = 3


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


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_launch_megatron_tp2_is_bounded_conserving_and_advancing(tmp_path):
    from staleflow.models.checkpoint import load_pretrained
    from staleflow.runtime.launch import launch

    result = launch(_config(tmp_path, "trainer.tp=2"))
    assert len(result.records) == STEPS
    ids: Counter[int] = Counter()
    for step in result.consumed:
        assert min(step["staleness"]) >= 0 and max(step["staleness"]) <= 3, step
        ids.update(step["traj_ids"])
        assert len(step["traj_ids"]) == 2 * 4
    assert max(ids.values()) == 1, "a trajectory was consumed twice"
    audit = result.summary["audit"]
    assert audit["routed"] == 0 and audit["on_instances"] == 0, audit
    assert audit["consumed"] == sum(ids.values())
    assert audit["created"] == (
        audit["consumed"] + audit["aborted"] + audit["queued"] + audit["completed"]
    ), audit
    versions = [
        max(v for k, v in rec.items() if k.startswith("rollout/version/")) for rec in result.records
    ]
    assert versions == sorted(versions) and versions[-1] >= 1, versions  # Pulled the ranks' Pushes
    for rec in result.records:
        assert rec["train/tokens"] > 0 and "train/push_wait_s" in rec
    # the final checkpoint: an HF folder and, inside, the distributed checkpoint
    model, tokenizer = load_pretrained(result.run_dir / "checkpoint")
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_key_value_heads == 2
    assert tokenizer.decode(tokenizer.encode("12+7=")) == "12+7="
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
    assert all(rec["train/tokens"] > 0 for rec in resumed.records)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["trainer.tp=3"], r"trainer.tp=3 does not divide the model's 4 attention heads, 2 KV"),
        (["model.preset=micro", "trainer.tp=2"], r"use trainer.tp in \[1\]"),
    ],
)
def test_settings_the_model_cannot_run_stop_launch_before_training(tmp_path, extra, match):
    from staleflow.models import build_arithmetic_model
    from staleflow.runtime.launch import LaunchError, check_trainer

    cfg = _config(tmp_path, *extra)
    model, _ = build_arithmetic_model(cfg.model.preset)
    with pytest.raises(LaunchError, match=match):
        check_trainer(cfg, model)


def test_a_checkpoint_of_another_architecture_stops_launch(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from staleflow.runtime.launch import LaunchError, check_trainer

    cfg = _config(tmp_path, f"model.checkpoint={tmp_path}")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=17))
    with pytest.raises(LaunchError, match=r"model_type 'gpt2' .* or trainer.backend=embedded"):
        check_trainer(cfg, gpt2)


def test_megatron_core_missing_stops_launch(tmp_path, monkeypatch):
    import importlib.util

    from staleflow.runtime.launch import LaunchError, check_backends

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name, *a),
    )
    with pytest.raises(LaunchError, match=r"pip install 'staleflow\[megatron\]'"):
        check_backends(_config(tmp_path))


def test_more_gpus_than_the_cluster_has_are_refused():
    from staleflow.config import TrainerConfig
    from staleflow.trainers.megatron.checks import TrainerSetupError, check_gpus

    section = TrainerConfig(backend="megatron", tp=2, dp=2, gpus_per_rank=1)
    check_gpus(section, 4.0)
    with pytest.raises(TrainerSetupError, match="needs 4 GPUs but the Ray cluster has 2"):
        check_gpus(section, 2.0)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(3600)
def test_the_default_run_learns_with_the_megatron_trainer(tmp_path):
    """``staleflow launch --eta 3 trainer.backend=megatron trainer.tp=2`` on the built-in
    task: the same bar as the embedded trainer's learning test
    (tests/staleflow/runtime/test_launch_learning.py)."""
    from staleflow.config import load_config
    from staleflow.runtime.launch import launch, reward_mean

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
    assert s["eval_reward_end"] > s["eval_reward_start"] + 0.04, s
    first, last = reward_mean(result.records[:50]), reward_mean(result.records[-50:])
    assert first is not None and last is not None
    assert last > first + 0.03, (first, last)
