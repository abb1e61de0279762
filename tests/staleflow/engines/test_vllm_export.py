"""vLLM loads what the trainers export: the embedded trainer's checkpoint (what a run
writes as ``<run>/checkpoint``, its final policy) and the Megatron pool's (the HF folder
``RankActor.save_checkpoint`` writes beside the distributed checkpoint), each trained a
step with the KL term on (so the folders hold everything a checkpoint holds: optimizer
and RNG state, the reference, Megatron's shards). Real vLLM (``vllm.LLM`` on the folder,
as a user serves it) decodes greedily the same tokens as the trainer's own model and as
``AutoModelForCausalLM.from_pretrained``. Runs in CI's vLLM stage (.ci/vllm, which also
installs megatron-core; the Megatron trainer runs on gloo in a child process)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from tests.staleflow.engines.backends import VLLM_SKIP, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason=VLLM_SKIP),
    pytest.mark.timeout(900),
]

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models.build import build_model  # noqa: E402
from staleflow.models.presets import ModelPreset  # noqa: E402
from tests.staleflow.trainers.masked import masked_batch  # noqa: E402

# head size 32: vLLM's CPU attention takes multiples of 32 (the micro preset's is 16)
PRESET = ModelPreset(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128
)
SETTINGS = {"lr": 1e-2, "kl_coef": 0.1}
TOKENS = 12


def _policy():
    """A policy whose greedy decoding varies from token to token (a freshly initialised
    one repeats a single token, which a wrongly loaded model could repeat too)."""
    _, tokenizer = build_arithmetic_model("micro")
    model = build_model(PRESET, tokenizer.vocab_size, seed=5)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    prompt = tokenizer.encode("12+3=", add_bos=True).astype(np.int64)
    return model, tokenizer, prompt


def _greedy(model, prompt: np.ndarray) -> tuple[list[int], list[float]]:
    """Argmax decoding by full forward passes (no KV cache: nothing of generate's): the
    tokens and their logprobs."""
    ids = torch.from_numpy(prompt)[None]
    logprobs = []
    with torch.no_grad():
        for _ in range(TOKENS):
            lp = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            nxt = lp.argmax()
            logprobs.append(float(lp[nxt]))
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist(), logprobs


def _transformers_greedy(folder, prompt: np.ndarray) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    return _greedy(model, prompt)


def _same(got: tuple[list[int], list[float]], expected: tuple[list[int], list[float]]) -> None:
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-4)  # float32 kernels apart


def _vllm_greedy(folder, prompt: np.ndarray) -> tuple[list[int], list[float]]:
    """The folder served by a plain ``vllm.LLM`` (no StaleFlow code), decoded greedily:
    the tokens and their logprobs."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(folder),
        skip_tokenizer_init=True,  # the built-in character tokenizer is StaleFlow's own
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
    )
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False, logprobs=0
        )
        out = llm.generate([{"prompt_token_ids": prompt.tolist()}], params, use_tqdm=False)
        done = out[0].outputs[0]
        tokens = list(done.token_ids)
        logprobs = [step[t].logprob for t, step in zip(tokens, done.logprobs, strict=True)]
        return tokens, logprobs
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_the_embedded_trainers_checkpoint_loads_in_vllm(tmp_path):
    from staleflow.trainers.embedded import EmbeddedTrainer

    model, tokenizer, prompt = _policy()
    initial = model.model.norm.weight.detach().clone()
    trainer = EmbeddedTrainer(
        model, TrainerConfig(**SETTINGS), pad_id=tokenizer.pad_id, tokenizer=tokenizer
    )
    trainer.train_step(masked_batch(model, tokenizer))
    trainer.save_checkpoint(tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "reference").is_dir()  # a KL run's checkpoint, whole
    assert not torch.equal(model.model.norm.weight, initial)  # trained weights were saved
    ours = _greedy(model.eval(), prompt)
    assert len(set(ours[0])) > 3  # a varied decoding: a wrong load shows
    _same(_transformers_greedy(tmp_path / "checkpoint", prompt), ours)
    _same(_vllm_greedy(tmp_path / "checkpoint", prompt), ours)


def test_the_megatron_pools_checkpoint_loads_in_vllm(tmp_path):
    if os.environ.get("STALEFLOW_REQUIRE_VLLM") != "1":
        pytest.importorskip(
            "megatron.core", reason="needs megatron-core: pip install '.[megatron]'"
        )
    from parameter_server.torch_compat import state_dict_to_numpy
    from staleflow.trainers.megatron.local import run_local
    from staleflow.trainers.megatron.rank import RankSpec
    from tests.staleflow.trainers.megatron_worker import train_and_export

    model, tokenizer, prompt = _policy()
    hf = {k: np.array(v, copy=True) for k, v in state_dict_to_numpy(policy_state(model)).items()}
    spec = RankSpec(
        model.config.to_dict(),
        TrainerConfig(backend="megatron", **SETTINGS),
        pad_id=tokenizer.pad_id,
        tokenizer=tokenizer,
    )
    folder = tmp_path / "checkpoint"
    payload = (spec, hf, masked_batch(model, tokenizer), str(folder), prompt, TOKENS)
    megatrons = run_local(1, train_and_export, payload, timeout_s=300)
    assert (folder / "megatron" / "common.pt").is_file()  # beside the HF folder, as a run's
    from safetensors.numpy import load_file

    saved = load_file(str(folder / "model.safetensors"))["model.norm.weight"]
    assert not np.array_equal(saved, hf["model.norm.weight"])  # trained weights were saved
    assert len(set(megatrons)) > 3  # a varied decoding: a wrong load shows
    exported = _transformers_greedy(folder, prompt)
    assert exported[0] == megatrons
    _same(_vllm_greedy(folder, prompt), exported)
