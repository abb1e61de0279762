"""The embedded GRPO trainer on a micro model: it learns from rewards, validates batches,
exports snapshots, and checkpoints."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.config import ConfigError, TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, load_pretrained, policy_state  # noqa: E402
from staleflow.trainers import METRIC_KEYS, Trainer, create_trainer, trainer_class  # noqa: E402
from staleflow.trainers.embedded import BatchError, EmbeddedTrainer  # noqa: E402
from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory  # noqa: E402

PROMPT = "12+3="
GOOD, BAD = "15", ("27", "30", "9")  # no wrong answer shares a prefix with the right one


def _setup(seed=0, **config):
    model, tokenizer = build_arithmetic_model("micro", seed=seed)
    trainer = EmbeddedTrainer(
        model,
        TrainerConfig(**{"lr": 1e-2, **config}),
        pad_id=tokenizer.pad_id,
        tokenizer=tokenizer,
    )
    return model, tokenizer, trainer


def _response_logprobs(model, tokenizer, prompt: str, text: str) -> np.ndarray:
    """Per-token logprobs of ``text`` + EOS after ``prompt`` under ``model`` now."""
    p = tokenizer.encode(prompt, add_bos=True)
    r = np.concatenate([tokenizer.encode(text), [tokenizer.eos_id]])
    ids = torch.from_numpy(np.concatenate([p, r]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp[len(p) - 1 :].numpy().astype(np.float32)


def _batch(model, tokenizer, rewards=(1.0, 0.0, 0.0, 0.0), version=0, shift=0.0):
    """One group: the right answer and three wrong ones, with on-policy behaviour
    logprobs (minus ``shift``: a stale behaviour policy)."""
    trajectories = []
    for i, (text, reward) in enumerate(zip((GOOD, *BAD), rewards, strict=True)):
        tokens = np.concatenate([tokenizer.encode(text), [tokenizer.eos_id]]).astype(np.int32)
        lp = _response_logprobs(model, tokenizer, PROMPT, text) - np.float32(shift)
        trajectories.append(
            TrainingTrajectory(
                traj_id=10 + i,
                v_traj=version,
                tokens=tokens,
                logprobs=lp,
                versions=np.full(len(tokens), version, np.int32),
                reward=reward,
                finish_reason="stop",
            )
        )
    prompt = tokenizer.encode(PROMPT, add_bos=True)
    return TrainingBatch((TrainingGroup(0, 0, "15", prompt, tuple(trajectories)),))


@pytest.mark.parametrize("off_policy", ["decoupled", "tis", "none"])
def test_rewarded_response_becomes_more_likely(off_policy):
    model, tokenizer, trainer = _setup(off_policy=off_policy)
    before = {t: _response_logprobs(model, tokenizer, PROMPT, t).sum() for t in (GOOD, *BAD)}
    for _ in range(4):
        trainer.train_step(_batch(model, tokenizer, version=trainer.version))
    after = {t: _response_logprobs(model, tokenizer, PROMPT, t).sum() for t in (GOOD, *BAD)}
    assert after[GOOD] > before[GOOD] + 0.5
    assert all(after[b] < before[b] for b in BAD)
    assert trainer.version == 4


@pytest.mark.parametrize("off_policy", ["decoupled", "tis"])
def test_several_updates_per_step_clip_against_the_weights_before_the_step(off_policy):
    """With mini-batches the proximal policy is the weights before the first update, so
    later updates see ratios away from 1 (and the clip can bite); learning still works."""
    model, tokenizer, trainer = _setup(off_policy=off_policy, updates_per_step=3)
    before = _response_logprobs(model, tokenizer, PROMPT, GOOD).sum()
    metrics = [trainer.train_step(_batch(model, tokenizer, version=v)) for v in range(3)]
    after = _response_logprobs(model, tokenizer, PROMPT, GOOD).sum()
    assert after > before + 0.5
    assert all(m["train/updates"] == 3.0 for m in metrics)
    assert any(abs(m["train/ratio_mean"] - 1.0) > 1e-4 for m in metrics)
    assert trainer.version == 3


def test_updates_per_step_must_be_positive():
    with pytest.raises(ConfigError, match="updates_per_step=0"):
        TrainerConfig(updates_per_step=0)


def test_metrics():
    model, tokenizer, trainer = _setup()
    metrics = trainer.train_step(_batch(model, tokenizer))
    assert set(METRIC_KEYS) <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    assert metrics["train/tokens"] == 3 + 3 + 3 + 2  # responses with their EOS
    assert metrics["train/response_len_mean"] == pytest.approx(11 / 4)
    assert metrics["train/reward_mean"] == pytest.approx(0.25)
    # on-policy behaviour: weight 1, no KL, no clipping
    assert metrics["train/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["train/kl_behav"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/clip_frac"] == 0.0
    assert metrics["train/corrected_frac"] == 0.0
    assert 0.0 < metrics["train/entropy"] <= math.log(17) + 1e-5
    assert metrics["train/grad_norm"] > 0


def test_stale_behaviour_policy_is_capped_or_clipped():
    # behaviour logprobs one nat below the trainer's: weight e > cap 2
    model, tokenizer, trainer = _setup(is_cap=2.0, off_policy="tis")  # truncates to the cap
    metrics = trainer.train_step(_batch(model, tokenizer, shift=1.0))
    assert metrics["train/importance_weight_mean"] == pytest.approx(2.0, rel=1e-5)
    assert metrics["train/is_capped_frac"] == 1.0
    assert metrics["train/clip_frac"] == 0.0
    assert metrics["train/corrected_frac"] == 1.0  # every token truncated
    assert metrics["train/kl_behav"] == pytest.approx(math.e - 2.0, rel=1e-4)
    # decoupled PPO drops the tokens above the cap (AReaL): no weight left, no update
    model, tokenizer, trainer = _setup(is_cap=2.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.train_step(_batch(model, tokenizer, shift=1.0))
    assert metrics["train/importance_weight_mean"] == 0.0
    assert metrics["train/is_capped_frac"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert metrics["train/clip_frac"] == 0.0
    assert metrics["train/kl_behav"] == pytest.approx(math.e - 2.0, rel=1e-4)
    # without a correction, PPO's ratio against the behaviour policy is e: clipped where A > 0
    model, tokenizer, trainer = _setup(off_policy="none")
    metrics = trainer.train_step(_batch(model, tokenizer, shift=1.0))
    assert metrics["train/clip_frac"] == pytest.approx(3 / 11)
    assert metrics["train/corrected_frac"] == pytest.approx(3 / 11)  # clipped, none capped
    assert metrics["train/ratio_mean"] == pytest.approx(math.e, rel=1e-4)


def test_flat_groups_leave_the_weights_alone():
    model, tokenizer, trainer = _setup()
    before = {k: v.clone() for k, v in policy_state(model).items()}
    metrics = trainer.train_step(_batch(model, tokenizer, rewards=(1.0, 1.0, 1.0, 1.0)))
    assert metrics["train/grad_norm"] == 0.0 and metrics["train/loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in policy_state(model).items())
    assert trainer.version == 1


def test_micro_batching_does_not_change_the_gradient():
    results = []
    for tokens in (1, 10_000):
        model, tokenizer, trainer = _setup(micro_batch_tokens=tokens)
        # plain SGD, so equal gradients mean equal updates (Adam's first step is sign-like)
        trainer.optimizer = torch.optim.SGD(trainer._params, lr=0.5)
        metrics = trainer.train_step(_batch(model, tokenizer))
        results.append((metrics, {k: v.clone() for k, v in policy_state(model).items()}))
    (m1, w1), (m2, w2) = results
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-5, abs=1e-7)
    assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=1e-5)
    assert all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)


def _replace_traj(batch, index, **changes):
    group = batch.groups[0]
    trajs = list(group.trajectories)
    trajs[index] = dataclasses.replace(trajs[index], **changes)
    return TrainingBatch((dataclasses.replace(group, trajectories=tuple(trajs)),))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"logprobs": np.zeros(2, np.float32)}, "3 tokens, 2 logprobs and 3 versions"),
        ({"versions": np.zeros(4, np.int32)}, "3 tokens, 3 logprobs and 4 versions"),
        ({"logprobs": np.array([-1.0, np.nan, -1.0], np.float32)}, "position 1 is not finite"),
        ({"logprobs": np.array([-1.0, 0.5, -1.0], np.float32)}, "0.5 at position 1 is positive"),
        ({"tokens": np.array([1, 2, 99], np.int32)}, "outside the model's vocabulary"),
        (
            {
                "tokens": np.zeros(0, np.int32),
                "logprobs": np.zeros(0, np.float32),
                "versions": np.zeros(0, np.int32),
            },
            "response is empty",
        ),
        ({"reward": float("nan")}, "reward nan is not finite"),
    ],
)
def test_bad_batches_are_rejected_naming_the_trajectory(changes, match):
    model, tokenizer, trainer = _setup()
    before = {k: v.clone() for k, v in policy_state(model).items()}
    batch = _replace_traj(_batch(model, tokenizer), 1, **changes)
    with pytest.raises(BatchError, match=f"trajectory 11 \\(group 0\\): .*{match}"):
        trainer.train_step(batch)
    assert trainer.version == 0
    assert all(torch.equal(before[k], v) for k, v in policy_state(model).items())


def test_empty_batch_is_rejected():
    _, _, trainer = _setup()
    with pytest.raises(BatchError, match="no trajectories"):
        trainer.train_step(TrainingBatch(()))


def test_export_weights_is_a_snapshot_by_policy_state_names():
    model, tokenizer, trainer = _setup()
    exported = trainer.export_weights()
    assert list(exported) == list(policy_state(model))
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in exported.values())
    frozen = {k: v.copy() for k, v in exported.items()}
    trainer.train_step(_batch(model, tokenizer))
    assert all(np.array_equal(frozen[k], exported[k]) for k in frozen)
    moved = trainer.export_weights()
    assert not np.array_equal(moved["model.norm.weight"], frozen["model.norm.weight"])


def test_checkpoint_round_trip(tmp_path):
    model, tokenizer, trainer = _setup()
    trainer.train_step(_batch(model, tokenizer))
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.save_checkpoint(tmp_path / "ckpt")  # replaces it
    batch = _batch(model, tokenizer, version=1)
    trainer.train_step(batch)
    expected = trainer.export_weights()

    _, _, other = _setup(seed=9)
    other.load_checkpoint(tmp_path / "ckpt")
    assert other.version == 1
    other.train_step(batch)
    assert other.version == 2
    got = other.export_weights()
    assert all(np.allclose(expected[k], got[k], atol=1e-7) for k in expected)
    # with its tokenizer, the checkpoint is also a loadable model directory
    _, loaded_tokenizer = load_pretrained(tmp_path / "ckpt")
    assert loaded_tokenizer.vocab_size == 17
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        other.load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"lr": 0.0}, "trainer.lr=0.0"),
        ({"off_policy": "ppo"}, "trainer.off_policy='ppo'"),
        ({"advantage": "rloo"}, "trainer.advantage='rloo'"),
        ({"is_cap": 0.5}, "trainer.is_cap=0.5"),
        ({"is_cap_mode": "clip"}, "trainer.is_cap_mode"),
        ({"eps_low": 1.5}, "trainer.eps_low=1.5"),
        ({"micro_batch_tokens": 0}, "trainer.micro_batch_tokens=0"),
        ({"adam_beta2": 1.0}, "trainer.adam_beta2=1.0"),
    ],
)
def test_settings_are_validated_where_they_are_defined(values, match):
    """The trainer takes the run configuration's ``trainer`` section itself: one
    definition of each setting, its default and its check."""
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**values)


def test_the_trainer_uses_the_sections_values():
    model, tokenizer = build_arithmetic_model("micro")
    section = TrainerConfig(lr=1e-3, adam_beta1=0.8, weight_decay=0.01, num_threads=2)
    trainer = EmbeddedTrainer.from_section(model, section, pad_id=tokenizer.pad_id, seed=7)
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.8, 0.999), 0.01)
    assert trainer.config is section and trainer.seed == 7 and trainer.num_threads == 2


def test_registry_and_protocol():
    assert trainer_class("embedded") is EmbeddedTrainer
    model, tokenizer = build_arithmetic_model("micro")
    trainer = create_trainer("embedded", model, pad_id=tokenizer.pad_id, version=5)
    assert isinstance(trainer, Trainer) and trainer.version == 5
    with pytest.raises(ValueError, match="unknown trainer 'deepspeed'"):
        trainer_class("deepspeed")


def test_trainers_package_imports_without_torch():
    code = (
        "import sys, staleflow.trainers as t; assert {'embedded', 'megatron'} <= set(t.TRAINERS); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _with_errors(batch: TrainingBatch, failed: set[int]) -> TrainingBatch:
    """``batch`` with the reward function having raised on trajectories ``failed``."""
    groups = []
    for g in batch.groups:
        trajs = tuple(
            dataclasses.replace(t, info={"reward_error": "ZeroDivisionError"})
            if t.traj_id in failed
            else t
            for t in g.trajectories
        )
        groups.append(dataclasses.replace(g, trajectories=trajs))
    return TrainingBatch(tuple(groups))


def test_a_failed_reward_is_not_trained_as_a_wrong_answer():
    # The good answer (id 10) and one wrong answer (id 11) were graded; the reward
    # function raised on the other two (ids 12, 13). Training must equal training on the
    # two graded ones alone: the failed ones neither get a negative advantage nor move
    # their siblings' group mean.
    model_a, tokenizer, errored = _setup(seed=3)
    model_b, _, graded_only = _setup(seed=3)
    batch = _batch(model_a, tokenizer)
    stats = errored.train_step(_with_errors(batch, {12, 13}))
    g = batch.groups[0]
    kept = TrainingBatch((dataclasses.replace(g, trajectories=g.trajectories[:2]),))
    graded_only.train_step(kept)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    assert stats["train/reward_errors"] == 2.0
    assert stats["train/trajectories"] == 2.0


def test_a_batch_whose_rewards_all_failed_advances_the_version_without_an_update():
    model, tokenizer, trainer = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.train_step(_with_errors(_batch(model, tokenizer), {10, 11, 12, 13}))
    assert trainer.version == 1  # the buffer was consumed: the version moves on
    assert stats["train/updates"] == 0.0
    assert stats["train/reward_errors"] == 4.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
