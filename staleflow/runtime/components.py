"""Building each actor's component from its section of the configuration.

Specs are plain picklable records: an actor receives its spec and builds what it needs
itself (the model architecture from its Hugging Face config dict, the weights from the
parameter server), so no model object ever crosses the network. Backends are imported
here, lazily, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staleflow.config.sections import TrainerConfig
from staleflow.runtime.interface import Rewarded
from staleflow.runtime.reward_stage import CompletionSink, RewardStage


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The policy's architecture (``model.config.to_dict()``), its PS layout and its
    tokenizer, as plain data."""

    hf_config: dict[str, Any]
    layout: dict[str, Any]
    tokenizer: tuple[str, str]  # ("char", alphabet) or ("hf", local path)
    eos_token_id: int
    pad_token_id: int


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    model: ModelSpec
    transport: str
    max_response: int
    max_seq_len: int
    kv_budget_tokens: int
    max_running: int
    temperature: float
    top_p: float
    num_threads: int
    seed: int

    @property
    def layout(self) -> dict[str, Any]:
        return self.model.layout


@dataclass(frozen=True, slots=True)
class RewardSpec:
    kind: str  # resolved: arithmetic | exact | math_verify
    timeout_s: float
    tokenizer: tuple[str, str]


@dataclass(frozen=True, slots=True)
class TrainerSpec:
    model: ModelSpec
    transport: str
    section: TrainerConfig = field(default_factory=TrainerConfig)  # the run's ``trainer``
    seed: int = 0
    consume_timeout_s: float | None = None
    checkpoint_dir: str = ""  # with checkpoint_every > 0: save every N steps under it
    checkpoint_every: int = 0

    @property
    def layout(self) -> dict[str, Any]:
        return self.model.layout

    @property
    def num_threads(self) -> int:
        return self.section.num_threads


# -- tokenizers and models ---------------------------------------------------------------


def tokenizer_spec(tokenizer: object) -> tuple[str, str]:
    from staleflow.data.tokenizer import CharTokenizer, HFTokenizer

    if isinstance(tokenizer, CharTokenizer):
        return ("char", tokenizer.alphabet)
    if isinstance(tokenizer, HFTokenizer):
        return ("hf", tokenizer._path)
    raise TypeError(f"cannot hand a {type(tokenizer).__name__} to other processes")


def tokenizer_from_spec(spec: tuple[str, str]) -> Any:
    from staleflow.data.tokenizer import CharTokenizer, HFTokenizer

    kind, value = spec
    return CharTokenizer(value) if kind == "char" else HFTokenizer(value)


def model_spec(model: Any, tokenizer: Any) -> ModelSpec:
    from parameter_server.torch_compat import layout_of_state_dict
    from staleflow.models.state import policy_state

    return ModelSpec(
        hf_config=model.config.to_dict(),
        layout=layout_of_state_dict(policy_state(model)).to_dict(),
        tokenizer=tokenizer_spec(tokenizer),
        eos_token_id=int(tokenizer.eos_id),
        pad_token_id=int(tokenizer.pad_id),
    )


def build_architecture(spec: ModelSpec, seed: int = 0) -> Any:
    """The model with freshly initialised weights; the caller loads real ones."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(spec.hf_config)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(torch.float32)


# -- components --------------------------------------------------------------------------


def build_engine(spec: RolloutSpec, seed: int) -> Any:
    from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

    model = build_architecture(spec.model, seed)
    config = EmbeddedEngineConfig(
        kv_budget_tokens=spec.kv_budget_tokens,
        max_running=spec.max_running,
        max_seq_len=spec.max_seq_len,
        temperature=spec.temperature,
        top_p=spec.top_p,
        eos_token_id=spec.model.eos_token_id,
        seed=seed,
        num_threads=spec.num_threads,
    )
    return EmbeddedEngine(model, config)


def build_trainer(spec: TrainerSpec, weights: Mapping[str, np.ndarray]) -> Any:
    """The embedded trainer, from the run's ``trainer`` section and the PS's weights."""
    from staleflow.models.state import load_policy_state
    from staleflow.trainers.embedded import EmbeddedTrainer

    model = build_architecture(spec.model)
    load_policy_state(model, weights)
    # the tokenizer goes into every checkpoint, so that model.checkpoint=<it> can resume
    tokenizer = tokenizer_from_spec(spec.model.tokenizer)
    return EmbeddedTrainer.from_section(
        model, spec.section, pad_id=spec.model.pad_token_id, seed=spec.seed, tokenizer=tokenizer
    )


def build_trainer_pool(spec: TrainerSpec, ps_endpoint: Any, ts_handle: Any) -> Any:
    """``trainer.backend=megatron``: the pool of Megatron ranks (Ray actors), built from
    the policy's HF config; its ranks load the PS's weights themselves."""
    from parameter_server import Layout
    from staleflow.trainers.megatron.pool import MegatronTrainer
    from staleflow.trainers.megatron.rank import RankSpec

    dtypes = {p.dtype for p in Layout.from_dict(spec.layout)}
    rank_spec = RankSpec(
        hf_config=spec.model.hf_config,
        section=spec.section,
        pad_id=spec.model.pad_token_id,
        seed=spec.seed,
        dtype=dtypes.pop() if len(dtypes) == 1 else "float32",
        tokenizer=tokenizer_from_spec(spec.model.tokenizer),
    )
    return MegatronTrainer(rank_spec, ps_endpoint=ps_endpoint, ts_handle=ts_handle)


@dataclass(frozen=True, slots=True)
class _Scored:
    reward: float
    error: str


def build_reward_stage(
    spec: RewardSpec, ts: CompletionSink, report: Callable[[Sequence[Rewarded]], None]
) -> RewardStage:
    from staleflow.rewards import RewardItem, RewardWorker
    from staleflow.rewards.worker import build_reward_fn

    worker = RewardWorker(build_reward_fn(spec.kind, spec.timeout_s), name=spec.kind)
    tokenizer = tokenizer_from_spec(spec.tokenizer)

    def score(items: Sequence[tuple[int, str, str]]) -> list[_Scored]:
        results = worker.score([RewardItem(t, text, answer) for t, text, answer in items])
        return [_Scored(r.reward, r.error) for r in results]

    return RewardStage(score, tokenizer.decode, ts, report)
