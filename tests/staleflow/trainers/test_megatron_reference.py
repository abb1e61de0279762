"""The reference policy and the KL term in the Megatron trainer, on CPU with the real
megatron-core, against the embedded trainer: the same loss, ``train/ref_kl``,
``train/kl_loss`` and weights over two steps, with the reference from a model folder
(``trainer.ref.path``) at TP = 2 (the vocabulary split: the reference's logprobs come
through the vocab-parallel path), at PP = 2 (the reference's forward-only pass goes
through Megatron's pipeline schedule) and the initial policy at TP = 1. Slow (real
process groups, 25-75 s each): run with ``-m slow``."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from parameter_server.torch_compat import state_dict_to_numpy  # noqa: E402
from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.config.loss import RefConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models.build import build_model  # noqa: E402
from staleflow.models.checkpoint import save_pretrained  # noqa: E402
from staleflow.models.presets import ModelPreset  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from staleflow.trainers.megatron.local import run_local  # noqa: E402
from staleflow.trainers.megatron.rank import RankSpec  # noqa: E402
from tests.staleflow.trainers.masked import masked_batch  # noqa: E402
from tests.staleflow.trainers.megatron_worker import consecutive_steps  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PRESET = ModelPreset(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)
SETTINGS = {"lr": 1e-2, "kl_coef": 0.5, "loss": "gspo", "kl_estimator": "k2"}
COMPARED = ("train/loss", "train/ref_kl", "train/kl_loss", "train/grad_norm", "train/tokens")


def _weights(model) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state_dict_to_numpy(policy_state(model)).items()}


def _both(settings: dict, tp: int, reference=None, pp: int = 1):
    _, tokenizer = build_arithmetic_model("micro")
    model = build_model(PRESET, tokenizer.vocab_size, seed=3)
    batch = masked_batch(model, tokenizer)
    embedded = EmbeddedTrainer(
        copy.deepcopy(model),
        TrainerConfig(**settings),
        pad_id=tokenizer.pad_id,
        reference=reference,
    )
    expected = [embedded.train_step(batch) for _ in range(2)]
    spec = RankSpec(
        model.config.to_dict(),
        TrainerConfig(backend="megatron", tp=tp, pp=pp, **settings),
        pad_id=0,
    )
    got, weights = run_local(tp * pp, consecutive_steps, (spec, _weights(model), [batch, batch]),
                             timeout_s=300)  # fmt: skip
    return expected, _weights(embedded.model), got, weights


def _assert_same(expected, w_expected, got, w_got):
    for e, g in zip(expected, got, strict=True):
        for key in COMPARED:
            assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key
    num = sum(float(np.sum((w_got[k] - w_expected[k]).astype(np.float64) ** 2)) for k in w_got)
    den = sum(float(np.sum(w_expected[k].astype(np.float64) ** 2)) for k in w_got)
    assert (num / den) ** 0.5 < 1e-4


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_reference_folder_takes_the_embedded_trainers_steps(tmp_path, tp, pp):
    _, tokenizer = build_arithmetic_model("micro")
    other = build_model(PRESET, tokenizer.vocab_size, seed=4)
    folder = save_pretrained(other, tokenizer, tmp_path / "ref")
    settings = {**SETTINGS, "ref": RefConfig(path=str(folder))}
    ref = copy.deepcopy(other).requires_grad_(False).eval()
    expected, w_expected, got, w_got = _both(settings, tp=tp, reference=ref, pp=pp)
    assert got[0]["train/ref_kl"] > 0 and got[0]["train/kl_loss"] > 0
    _assert_same(expected, w_expected, got, w_got)


def test_the_initial_policy_is_the_default_reference_at_tp1():
    expected, w_expected, got, w_got = _both(SETTINGS, tp=1)
    assert got[0]["train/ref_kl"] == 0.0  # the policy is its own reference at first
    assert got[1]["train/ref_kl"] > 0  # then it moved, the reference did not
    _assert_same(expected, w_expected, got, w_got)
