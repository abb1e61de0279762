"""A resumed Megatron run keeps its reference policy: the distributed checkpoint holds the
frozen reference (the initial policy), and a pool that loads it takes the same next step,
KL included, as the pool that never stopped, not a step whose KL is to the weights it
resumed from. Real megatron-core on gloo at TP = 1, TP = 2 (the reference's shards) and
PP = 2 (each stage's, the last one's tied output layer). (The embedded trainer's:
tests/staleflow/trainers/test_trainers_reference.py.) Slow: run with ``-m slow``."""

from __future__ import annotations

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
from staleflow.trainers.megatron.local import run_local  # noqa: E402
from staleflow.trainers.megatron.rank import RankSpec  # noqa: E402
from tests.staleflow.trainers.masked import masked_batch  # noqa: E402
from tests.staleflow.trainers.megatron_worker import resumed_reference  # noqa: E402

# gloo ranks in child processes: 20-150 s each here (by load), past the default run's few
# seconds. By default, the embedded trainer's resume keeps its reference
# (test_trainers_reference.py) and a Megatron checkpoint without a reference round-trips
# (test_megatron_equivalence.py); this is the Megatron reference's own check.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PRESET = ModelPreset(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_a_resumed_pool_keeps_the_initial_policy_as_its_reference(tmp_path, tp, pp):
    _, tokenizer = build_arithmetic_model("micro")
    model = build_model(PRESET, tokenizer.vocab_size, seed=3)
    hf = {k: np.array(v, copy=True) for k, v in state_dict_to_numpy(policy_state(model)).items()}
    section = TrainerConfig(
        backend="megatron", tp=tp, pp=pp, lr=1e-2, kl_coef=0.5, kl_estimator="k2"
    )
    spec = RankSpec(model.config.to_dict(), section, pad_id=tokenizer.pad_id)
    batch = masked_batch(model, tokenizer)
    payload = (spec, hf, batch, str(tmp_path / "ckpt"))
    out = run_local(tp * pp, resumed_reference, payload, timeout_s=480)
    assert out["policy_moved"] and out["reference_is_initial"]
    straight, resumed = out["straight"], out["resumed"]
    assert straight["train/ref_kl"] > 0  # the policy left its reference in step 1
    for key in ("train/ref_kl", "train/kl_loss", "train/loss", "train/grad_norm"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-7), key
