"""The loss mask in the Megatron trainer (issue 34), on CPU with the real megatron-core
at TP = 1 (one gloo process): observation tokens change nothing, training them would
change the step, and a masked batch takes the embedded trainer's step."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from parameter_server.torch_compat import state_dict_to_numpy  # noqa: E402
from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models.build import build_model  # noqa: E402
from staleflow.models.presets import ModelPreset  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from staleflow.trainers.megatron.local import run_local  # noqa: E402
from staleflow.trainers.megatron.rank import RankSpec  # noqa: E402
from tests.staleflow.trainers.masked import masked_batch, perturb_observations, unmasked  # noqa: E402
from tests.staleflow.trainers.megatron_worker import fresh_steps  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PRESET = ModelPreset(
    hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64
)
# an IS cap and a clip that bite on the stale members
SETTINGS = {"lr": 1e-2, "is_cap": 1.2, "eps_low": 0.05, "eps_high": 0.05}
COMPARED = (
    "train/loss",
    "train/grad_norm",
    "train/tokens",
    "train/corrected_frac",
    "train/clip_frac",
    "train/is_capped_frac",
    "train/importance_weight_mean",
    "train/kl_behav",
    "train/entropy",
    "train/token_staleness_mean",
    "train/token_staleness_max",
)


def _weights(model) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state_dict_to_numpy(policy_state(model)).items()}


@pytest.fixture(scope="module")
def steps():
    _, tokenizer = build_arithmetic_model("micro")
    model = build_model(PRESET, tokenizer.vocab_size, seed=3)
    batch = masked_batch(model, tokenizer)
    hf_config, hf = model.config.to_dict(), _weights(model)
    embedded = EmbeddedTrainer(
        copy.deepcopy(model), TrainerConfig(**SETTINGS), pad_id=tokenizer.pad_id
    )
    spec = RankSpec(hf_config, TrainerConfig(backend="megatron", **SETTINGS), pad_id=0)
    batches = [batch, perturb_observations(batch), unmasked(batch)]
    megatron = run_local(1, fresh_steps, (spec, hf, batches), timeout_s=300)
    return {
        "batch": batch,
        "embedded": (embedded.train_step(batch), _weights(embedded.model)),
        "megatron": megatron,
    }


def test_observation_tokens_change_nothing_in_a_megatron_step(steps):
    (base, w_base), (perturbed, w_perturbed), _ = steps["megatron"]
    for key in COMPARED:
        assert base[key] == perturbed[key], key
    assert all(np.array_equal(w_base[k], w_perturbed[k]) for k in w_base)
    trained = sum(int(t.mask.sum()) for g in steps["batch"].groups for t in g.trajectories)
    assert base["train/tokens"] == trained
    assert 0 < base["train/corrected_frac"] < 1  # the correction is at work, on model tokens


def test_training_the_observations_too_would_change_the_megatron_step(steps):
    (base, w_base), _, (all_in, w_all_in) = steps["megatron"]
    assert all_in["train/tokens"] > base["train/tokens"]
    assert all_in["train/loss"] != base["train/loss"]
    assert any(not np.array_equal(w_base[k], w_all_in[k]) for k in w_base)


def test_a_masked_batch_takes_the_embedded_trainers_step(steps):
    metrics, weights = steps["embedded"]
    (base, w_base), *_ = steps["megatron"]
    for key in COMPARED:
        assert base[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    num = sum(float(np.sum((w_base[k] - weights[k]).astype(np.float64) ** 2)) for k in weights)
    den = sum(float(np.sum(weights[k].astype(np.float64) ** 2)) for k in weights)
    assert (num / den) ** 0.5 < 1e-4
