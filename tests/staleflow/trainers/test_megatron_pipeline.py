"""Pipeline parallelism of the Megatron trainer, on CPU with the real megatron-core.

The same weights and batch (sampled by the embedded engine at T = 0.7) through two steps
at PP = 1 (one gloo process) and at PP = 2 (two: one layer each; the built-in policy's
tied embeddings live on both stages). The batch is cut into several micro-batches and
two updates per step, so PP = 2 runs Megatron's 1F1B schedule with a warm-up, a steady
state and a cool-down, and a forward-only pass for the proximal logprobs. Both pools Push
to a real PS worker; PP = 2 writes a distributed checkpoint after its first step that a
PP = 1 pool loads and continues from. A Qwen3 with untied embeddings takes one step at
PP = 1 and PP = 2.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model  # noqa: E402
from staleflow.models.build import build_model  # noqa: E402
from staleflow.trainers.megatron.rank import RankSpec  # noqa: E402
from tests.staleflow.trainers.megatron_worker import Script, run  # noqa: E402
from tests.staleflow.trainers.sampled import sample_batch  # noqa: E402
from tests.staleflow.trainers.test_megatron_equivalence import (  # noqa: E402
    PRESET,
    SETTINGS,
    _megatron,
    _other_architectures,
    _perturbed,
    _relative,
    _same_step,
    _weights,
    _with_ps,
)

pytestmark = pytest.mark.timeout(900)

# 16 trajectories in micro-batches of 3, two updates a step: 3 micro-batches per update
PIPELINE = {**SETTINGS, "micro_batch_size": 3, "updates_per_step": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("pipeline") / "ckpt-pp2"
    _, tokenizer = build_arithmetic_model("micro")
    model = _perturbed(build_model(PRESET, tokenizer.vocab_size, seed=3), 2)
    hf_config, hf = model.config.to_dict(), _weights(model)
    batch = sample_batch(model, tokenizer, temperature=0.7, groups=4, group_size=4)
    # a Qwen3 with untied embeddings: the last stage's output layer is its own weight
    qwen3_config, qwen3, _ = _other_architectures(tokenizer.vocab_size)[1]
    return {
        "hf": hf,
        "untied": [_megatron(qwen3_config, qwen3, batch, pp=pp) for pp in (1, 2)],
        "pp1": _with_ps(hf_config, hf, batch, steps=2, settings=PIPELINE),
        "pp2": _with_ps(hf_config, hf, batch, pp=2, steps=1, save=str(ckpt), settings=PIPELINE),
        "pp1_from_pp2": run(
            Script(_spec(hf_config, pp=1), hf, batch, steps=1, load=str(ckpt)), timeout_s=600
        ),
    }


def _spec(hf_config, *, pp):
    return RankSpec(hf_config, TrainerConfig(backend="megatron", pp=pp, **PIPELINE), pad_id=0)


def test_pp2_takes_the_same_step_as_pp1(runs):
    (pp1, _, _), (pp2, _, _) = runs["pp1"], runs["pp2"]
    metrics = pp2["metrics"][0]
    assert metrics["train/updates"] == 2.0
    assert metrics["train/grad_norm"] > SETTINGS["max_grad_norm"]  # the clip is active
    _same_step(pp1["metrics"][0], pp1["after"][0], metrics, pp2["final"])
    assert _relative(runs["hf"], pp2["final"]) > 1e-2  # far beyond the tolerance


def test_pp2_takes_the_same_step_with_untied_embeddings(runs):
    pp1, pp2 = runs["untied"]
    assert "output_layer.weight" not in pp2["names"]  # rank 0 is the first stage
    _same_step(pp1["metrics"][0], pp1["final"], pp2["metrics"][0], pp2["final"])


def test_each_stage_holds_its_own_layers_by_global_number(runs):
    (pp2, _, _) = runs["pp2"]
    names = pp2["names"]  # rank 0: the first stage, its names by global layer number
    assert "embedding.word_embeddings.weight" in names
    assert any(n.startswith("decoder.layers.0.") for n in names)
    assert not any(n.startswith("decoder.layers.1.") for n in names)
    assert "decoder.final_layernorm.weight" not in names


def test_pp2_loads_and_gathers_hf_weights_exactly(runs):
    hf, (pp2, _, _) = runs["hf"], runs["pp2"]
    assert set(pp2["loaded"]) == set(hf)
    assert all(np.array_equal(pp2["loaded"][k], hf[k]) for k in hf)


def test_every_stage_pushes_its_layers_and_the_ps_serves_pp1s_weights(runs):
    (_, v1, pulled1), (pp2, v2, pulled2) = runs["pp1"], runs["pp2"]
    assert (v1, v2) == (2, 1)
    assert set(pulled2[1]) == set(pulled1[1])
    # exactly the weights the PP = 2 pool holds, and PP = 1's to the step's tolerance
    assert all(np.array_equal(pulled2[1][k], pp2["final"][k]) for k in pulled2[1])
    assert _relative(pulled1[1], pulled2[1]) < 1e-4
    # each stage sent its own layers: neither sent the whole model
    total = sum(a.nbytes for a in runs["hf"].values())
    assert 0 < pp2["push_bytes"] < total


def test_a_checkpoint_written_at_pp2_loads_at_pp1(runs):
    """Weights, AdamW moments and version: the PP = 1 pool that resumes from PP = 2's
    checkpoint after step 1 takes the same step 2 as a PP = 1 pool that never stopped."""
    (pp1, _, _), (pp2, _, _), resumed = runs["pp1"], runs["pp2"], runs["pp1_from_pp2"]
    assert pp2["version"] == 1 and resumed["version"] == 2
    assert all(np.array_equal(resumed["loaded"][k], pp2["final"][k]) for k in pp2["final"])
    _same_step(pp1["metrics"][1], pp1["after"][1], resumed["metrics"][0], resumed["final"])
