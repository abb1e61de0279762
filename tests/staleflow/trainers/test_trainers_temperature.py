"""Issue #16: the trainer scores its policy at the rollout temperature.

The engines record ``log_softmax(logits / T)`` of each sampled token; a trainer that
scored the same weights at temperature 1 would see importance weights ``π_prox / π_behav``
far from 1 on exactly on-policy data, and reweight tokens by a ratio of two different
distributions. On-policy (the first step, from the weights that sampled), every weight
must be 1.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from tests.staleflow.trainers.sampled import sample_batch  # noqa: E402


@pytest.mark.parametrize("off_policy", ["decoupled", "tis"])
def test_on_policy_importance_weights_are_one_at_temperature_0_7(off_policy):
    model, tokenizer = build_arithmetic_model("micro", seed=1)
    batch = sample_batch(model, tokenizer, temperature=0.7)
    assert batch.temperature == 0.7
    trainer = EmbeddedTrainer(model, TrainerConfig(off_policy=off_policy), pad_id=tokenizer.pad_id)
    metrics = trainer.train_step(batch)
    assert metrics["train/importance_weight_min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/importance_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/kl_behav"] == pytest.approx(0.0, abs=1e-6)


def test_the_weights_would_be_off_at_temperature_1():
    """The same batch scored as if sampled at T = 1: the weights leave 1 by far more than
    the tolerance above, so that test can fail."""
    import dataclasses

    model, tokenizer = build_arithmetic_model("micro", seed=1)
    batch = dataclasses.replace(sample_batch(model, tokenizer, temperature=0.7), temperature=1.0)
    trainer = EmbeddedTrainer(model, TrainerConfig(), pad_id=tokenizer.pad_id)
    metrics = trainer.train_step(batch)
    spread = metrics["train/importance_weight_max"] - metrics["train/importance_weight_min"]
    assert spread > 1e-2


def test_the_temperature_travels_with_the_batch_from_the_trajectory_server():
    """The TS stamps every batch it hands out with the rollout temperature it was given
    (launch passes rollout.temperature), and the wire form between processes keeps it."""
    from dataclasses import dataclass

    import numpy as np

    from trajectory_server import TrajectoryServer, TrajectoryServerConfig, wire
    from trajectory_server.errors import InvalidConfig

    @dataclass(frozen=True)
    class Sample:
        sample_id: int
        prompt_ids: np.ndarray
        answer: str

    class Prompts:
        def next_sample(self):
            return Sample(0, np.array([1, 2], np.int32), "3")

    ts = TrajectoryServer(TrajectoryServerConfig(temperature=0.7), Prompts())
    traj = ts.routing_view()[0]
    ts.route([traj.traj_id], 0, "i0")
    tokens = np.array([5, 2], np.int32)
    ts.complete(
        traj.traj_id, tokens, np.full(2, -0.5, np.float32), np.zeros(2, np.int32), 1.0, "stop"
    )
    batch = ts.take_batch([traj.group_id])
    assert batch.temperature == 0.7
    assert wire.unpack(wire.pack(batch)).temperature == 0.7
    with pytest.raises(InvalidConfig, match="temperature=0"):
        TrajectoryServerConfig(temperature=0)
