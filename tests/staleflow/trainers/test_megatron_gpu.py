"""The Megatron equivalence at bfloat16 on GPUs (NCCL, Megatron's own optimizer): skipped
where no CUDA GPU is visible (as on this project's CI), run where one is.

bf16 weights and activations carry about 3 significant digits, so the bounds are those of
bf16 rounding, not the float32 bounds of test_megatron_equivalence.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from parameter_server.torch_compat import to_numpy  # noqa: E402
from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model  # noqa: E402
from staleflow.models.build import build_model  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from staleflow.trainers.megatron.rank import RankSpec  # noqa: E402
from tests.staleflow.trainers.megatron_worker import Script, run  # noqa: E402
from tests.staleflow.trainers.sampled import sample_batch  # noqa: E402
from tests.staleflow.trainers.test_megatron_equivalence import (  # noqa: E402
    PRESET,
    SETTINGS,
    _perturbed,
    _relative,
    _weights,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def _bf16(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: to_numpy(torch.from_numpy(v).to(torch.bfloat16)).copy() for k, v in weights.items()}


def _float(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).float().numpy()
        for k, v in weights.items()
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_megatron_on_gpus_takes_the_embedded_step(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    _, tokenizer = build_arithmetic_model("micro")
    model = _perturbed(build_model(PRESET, tokenizer.vocab_size, seed=3), 2)
    batch = sample_batch(model, tokenizer, temperature=0.7, groups=4, group_size=4)
    # the reference: the embedded trainer in float32 from the bf16-rounded weights
    start = _float(_bf16(_weights(model)))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.from_numpy(start[name]))
    embedded = EmbeddedTrainer(reference, TrainerConfig(**SETTINGS), pad_id=tokenizer.pad_id)
    expected = embedded.train_step(batch)
    spec = RankSpec(
        model.config.to_dict(),
        TrainerConfig(backend="megatron", tp=tp, **SETTINGS),
        pad_id=tokenizer.pad_id,
        dtype="bfloat16",
    )
    result = run(Script(spec, _bf16(_weights(model)), batch))
    got = result["metrics"][0]
    assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=5e-2, abs=5e-3)
    assert got["train/importance_weight_mean"] == pytest.approx(1.0, abs=2e-2)
    assert _relative(_weights(reference), _float(result["final"])) < 2e-2
