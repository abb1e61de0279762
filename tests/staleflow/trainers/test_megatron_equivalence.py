"""The Megatron trainer against the embedded one, on CPU with the real megatron-core.

From the same weights and the same batch (sampled by the embedded engine at T = 0.7),
one step of: the embedded trainer; Megatron at TP = 1 (one gloo process); TP = 2 (two);
DP = 2 (two, each with its half of the groups). All must give the same loss, metrics and
weights; the weights reach the HF names through the converter exactly; each rank Pushes
its own shards to a real PS worker; a distributed checkpoint written at TP = 2 loads at
TP = 1. The ranks run once per module (:func:`runs`); the tests read their results.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from parameter_server.torch_compat import state_dict_to_numpy  # noqa: E402
from parameter_server.transport import connect  # noqa: E402
from parameter_server.worker import PSWorker  # noqa: E402
from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models.build import build_model  # noqa: E402
from staleflow.models.presets import ModelPreset  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402
from staleflow.trainers.megatron.rank import RankSpec  # noqa: E402
from tests.staleflow.trainers.megatron_worker import Script, run  # noqa: E402
from tests.staleflow.trainers.sampled import sample_batch  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# GQA with 2 KV heads (so TP = 2 splits them), tied embeddings (the built-in policy's).
PRESET = ModelPreset(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)
# lr high enough to move the weights visibly; a clip bound below the gradient norm so
# that the TP-aware clip is exercised
SETTINGS = {"lr": 1e-2, "max_grad_norm": 0.5}
IDS = np.array([[1, 4, 5, 6, 7, 9, 3, 2], [1, 8, 8, 12, 3, 11, 2, 0]], dtype=np.int64)


def _weights(model) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state_dict_to_numpy(policy_state(model)).items()}


def _perturbed(model, seed: int):
    """Random norms and biases too, so a misplaced one cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _other_architectures(vocab: int) -> list[tuple[dict, dict, np.ndarray]]:
    """A Llama (no QKV bias) and a Qwen3 (per-head q/k norms, head_dim != hidden/heads,
    untied): HF config, weights and ``transformers`` logits of :data:`IDS`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    out = []
    for cls, config in (
        (LlamaForCausalLM, LlamaConfig(**shape, tie_word_embeddings=False)),
        (Qwen3ForCausalLM, Qwen3Config(**shape, head_dim=16, tie_word_embeddings=False)),
    ):
        torch.manual_seed(0)
        model = _perturbed(cls(config).float().eval(), 1)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(IDS)).logits.numpy()
        out.append((model.config.to_dict(), _weights(model), logits))
    return out


def _megatron(hf_config: dict, hf: dict, batch, *, tp=1, dp=1, pp=1, settings=SETTINGS, **kw):
    spec = RankSpec(
        hf_config,
        TrainerConfig(backend="megatron", tp=tp, dp=dp, pp=pp, **settings),
        pad_id=0,
    )
    return run(Script(spec, hf, batch, **kw))


def _with_ps(hf_config, hf, batch, **kw):
    """A Megatron run whose ranks Push their shards to a real PS worker (holding version
    0); returns the run's result, the PS's latest version and the weights of each
    version it holds after it."""
    from parameter_server.layout import Layout

    layout = Layout.from_arrays(hf)
    worker = PSWorker.start(layout, 3)
    try:
        with connect(worker.endpoint, "auto") as client:
            client.push(hf, 0)
            result = _megatron(hf_config, hf, batch, push_endpoint=worker.endpoint, **kw)
            version = client.info().latest
            pulled = {}
            for held in client.info().held:
                buffer = np.empty(layout.nbytes, dtype=np.uint8)
                client.pull(buffer, held)
                pulled[held] = {k: v.copy() for k, v in layout.views(buffer).items()}
    finally:
        worker.stop()
    return result, version, pulled


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    _, tokenizer = build_arithmetic_model("micro")
    model = _perturbed(build_model(PRESET, tokenizer.vocab_size, seed=3), 2)
    hf_config, hf = model.config.to_dict(), _weights(model)
    batch = sample_batch(model, tokenizer, temperature=0.7, groups=4, group_size=4)
    with torch.no_grad():
        reference_logits = model(input_ids=torch.from_numpy(IDS)).logits.numpy()
    embedded = EmbeddedTrainer(
        copy.deepcopy(model), TrainerConfig(**SETTINGS), pad_id=tokenizer.pad_id
    )
    others = _other_architectures(tokenizer.vocab_size)
    embedded_metrics = embedded.train_step(batch)
    ckpt = tmp / "ckpt-tp2"
    other_specs = [
        (RankSpec(cfg, TrainerConfig(backend="megatron", **SETTINGS)), w) for cfg, w, _ in others
    ]
    out = {
        "hf": hf,
        "hf_config": hf_config,
        "ckpt": ckpt,
        "reference_logits": reference_logits,
        "other_reference_logits": [logits for *_, logits in others],
        "embedded": (embedded_metrics, _weights(embedded.model)),
        "tp1": _megatron(
            hf_config,
            hf,
            batch,
            steps=2,
            logits_of=IDS,
            others=other_specs,
            greedy_from=IDS[0, :4],
        ),
        "tp2": _with_ps(hf_config, hf, batch, tp=2, logits_of=IDS, save=str(ckpt)),
        "dp2": _with_ps(hf_config, hf, batch, dp=2, steps=2, hold_push=True),
        "tp1_from_tp2": _megatron(hf_config, hf, batch, steps=1, load=str(ckpt)),
        # trainer.stream: group 0 alone (replica 1's share is empty), then groups 1 and 2,
        # then the step with group 3
        "dp2_streamed": _megatron(hf_config, hf, batch, dp=2, stream_parts=((0,), (1, 2))),
    }
    return out


def _relative(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    num = sum(float(np.sum((a[k] - b[k]).astype(np.float64) ** 2)) for k in a)
    den = sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a)
    return (num / den) ** 0.5


COMPARED = (
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/importance_weight_mean",
    "train/kl_behav",
    "train/clip_frac",
    "train/reward_mean",
    "train/reward_std",
    "train/advantage_abs_mean",
    "train/tokens",
    "train/trajectories",
    "train/response_len_mean",
    "train/response_len_max",
)


def _same_step(a: dict, wa: dict, b: dict, wb: dict) -> None:
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    for key in COMPARED:
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert set(wa) == set(wb)
    assert _relative(wa, wb) < 1e-4


def test_hf_to_megatron_to_hf_round_trips_exactly(runs):
    """The converter's HF -> Megatron shards load into the real model's parameters
    (every name, every shape), and gathering them back gives the HF weights bit for bit,
    at TP = 1 and TP = 2."""
    hf = runs["hf"]
    for result in (runs["tp1"], runs["tp2"][0], runs["dp2"][0]):
        assert set(result["loaded"]) == set(hf)
        assert all(np.array_equal(result["loaded"][k], hf[k]) for k in hf)
    names = runs["tp1"]["names"]
    assert "output_layer.weight" not in names  # tied: Megatron shares the embedding
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in names


def test_megatron_logits_match_transformers(runs):
    vocab = runs["reference_logits"].shape[-1]
    for result in (runs["tp1"], runs["tp2"][0]):
        got = result["logits"][..., :vocab]
        np.testing.assert_allclose(got, runs["reference_logits"], atol=1e-5)
    # Llama and Qwen3 layouts, from their HF configs
    for got, want in zip(runs["tp1"]["other_logits"], runs["other_reference_logits"], strict=True):
        np.testing.assert_allclose(got[..., :vocab], want, atol=1e-5)


def test_tp1_takes_the_embedded_trainers_step(runs):
    metrics, weights = runs["embedded"]
    tp1 = runs["tp1"]
    assert metrics["train/grad_norm"] > SETTINGS["max_grad_norm"]  # the clip is active
    _same_step(metrics, weights, tp1["metrics"][0], tp1["after"][0])
    # and the step moved the weights far more than the tolerance
    assert _relative(runs["hf"], weights) > 1e-2


def test_tp2_equals_tp1(runs):
    tp1, (tp2, _, _) = runs["tp1"], runs["tp2"]
    _same_step(tp1["metrics"][0], tp1["after"][0], tp2["metrics"][0], tp2["final"])


def test_dp2_equals_dp1(runs):
    tp1, (dp2, _, _) = runs["tp1"], runs["dp2"]
    for step in (0, 1):
        _same_step(
            tp1["metrics"][step], tp1["after"][step], dp2["metrics"][step], dp2["after"][step]
        )


def test_a_streamed_dp2_step_takes_the_step_on_the_whole_batch(runs):
    """trainer.stream on the Megatron ranks: the groups trained in parts before the step
    (each part shared out over the two replicas, one share empty) give TP = 1's step on
    the whole batch: the token-level mean over the whole batch, one update."""
    streamed, tp1 = runs["dp2_streamed"], runs["tp1"]
    _same_step(streamed["metrics"][0], streamed["after"][0], tp1["metrics"][0], tp1["after"][0])
    assert streamed["metrics"][0]["train/streamed_parts"] == 3  # two streamed, the rest


def test_on_policy_importance_weights_are_one_at_temperature_0_7(runs):
    """Issue #16 for the Megatron trainer: the batch's logprobs are the engine's at
    T = 0.7; scored at the same T, every on-policy weight is 1."""
    for metrics in (runs["tp1"]["metrics"][0], runs["tp2"][0]["metrics"][0]):
        assert metrics["train/importance_weight_min"] == pytest.approx(1.0, abs=1e-5)
        assert metrics["train/importance_weight_max"] == pytest.approx(1.0, abs=1e-5)


def test_every_rank_pushes_its_shards_and_the_ps_serves_hf_weights(runs):
    for name, steps in (("tp2", 1), ("dp2", 2)):
        result, version, pulled = runs[name]
        assert version == steps, name  # every version's Pushes completed
        for v in range(1, steps + 1):
            assert all(np.array_equal(pulled[v][k], result["after"][v - 1][k]) for k in pulled[v])


def test_a_push_overlapped_with_the_next_step_is_fenced_before_the_update(runs):
    """In the DP = 2 run each Push of version 1 was held until step 2's forward pass had
    begun: it ran during step 2, and still the PS's version 1 is exactly the weights
    after step 1 (the update of step 2 waited for it, and reported waiting)."""
    result, _, pulled = runs["dp2"]
    assert all(np.array_equal(pulled[1][k], result["after"][0][k]) for k in pulled[1])
    assert not np.array_equal(
        result["after"][0]["model.norm.weight"], result["after"][1]["model.norm.weight"]
    )
    assert result["metrics"][1]["train/push_wait_s"] > 0.0
    # data-parallel replicas split their shard's bytes between them (App. A.2's plan)
    total = sum(a.nbytes for a in runs["hf"].values())
    assert runs["dp2"][0]["push_bytes"] < 0.75 * total


def test_a_checkpoint_written_at_tp2_loads_at_tp1(runs):
    """Weights, AdamW moments and version: the TP = 1 pool that resumes from TP = 2's
    checkpoint after step 1 takes the same step 2 as a TP = 1 pool that never stopped."""
    tp1, tp2, resumed = runs["tp1"], runs["tp2"][0], runs["tp1_from_tp2"]
    assert tp2["version"] == 1 and resumed["version"] == 2
    assert all(np.array_equal(resumed["loaded"][k], tp2["final"][k]) for k in tp2["final"])
    _same_step(tp1["metrics"][1], tp1["after"][1], resumed["metrics"][0], resumed["final"])


def test_a_checkpoint_of_another_model_is_refused_by_name(runs):
    from staleflow.trainers.megatron.checks import TrainerSetupError, check_checkpoint

    section = TrainerConfig(backend="megatron", load=str(runs["ckpt"]))
    policy = "/runs/x/checkpoint"  # the HF folder beside it, as rollout's version 0
    check_checkpoint(section, runs["hf_config"], policy)  # its own model: fine
    other = {**runs["hf_config"], "num_hidden_layers": 3}
    with pytest.raises(TrainerSetupError, match=r"num_hidden_layers 2 \(checkpoint\) vs 3"):
        check_checkpoint(section, other, policy)
    parent = TrainerConfig(backend="megatron", load=str(runs["ckpt"].parent))
    with pytest.raises(TrainerSetupError, match="not a Megatron distributed checkpoint"):
        check_checkpoint(parent, other, policy)
    with pytest.raises(TrainerSetupError, match=r"set model\.checkpoint to the HF folder"):
        check_checkpoint(section, runs["hf_config"])


def test_the_hf_export_of_trained_megatron_weights_generates_megatrons_tokens(runs, tmp_path):
    """The pool's final checkpoint is ``export_hf`` of the ranks' gathered weights (the
    call MegatronTrainer.save_checkpoint makes): transformers loads it with
    ``from_pretrained`` and decodes greedily the tokens Megatron's own model decodes."""
    from transformers import AutoModelForCausalLM

    from staleflow.trainers.megatron.checkpoint import export_hf

    result = runs["tp1"]
    path = export_hf(result["final"], runs["hf_config"], tmp_path / "export", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ids = torch.from_numpy(IDS[:1, :4])
    with torch.no_grad():
        for _ in range(len(result["greedy"])):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert ids[0, 4:].tolist() == result["greedy"]
    assert result["final"]["model.norm.weight"].tolist() != runs["hf"]["model.norm.weight"].tolist()
