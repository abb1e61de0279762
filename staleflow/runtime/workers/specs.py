"""Building each actor's component from its section of the configuration.

Specs are plain picklable records: an actor receives its spec and builds what it needs
itself (the model architecture from its Hugging Face config dict, the weights from the
parameter server), so no model object ever crosses the network. Backends are imported
here, lazily, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from parameter_server.layout import Layout
from parameter_server.torch_compat import layout_of_state_dict, state_dict_to_numpy
from staleflow.config.env import ENV_TASKS
from staleflow.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from staleflow.engines import engine_class
from staleflow.engines.drafts import DraftSettings, SpeculationSettings
from staleflow.engines.factory import build_engine
from staleflow.engines.settings import EngineSettings
from staleflow.envs import EpisodeLimits, environment_target, make_environment
from staleflow.envs.formats import turn_format
from staleflow.models import lora as lora_lib
from staleflow.rewards import RewardItem, RewardWorker
from staleflow.rewards.confinement import Limits
from staleflow.rewards.worker import build_reward_fn
from staleflow.runtime.interface import Rewarded
from staleflow.runtime.workers.env_sandbox import SandboxedSteps
from staleflow.runtime.workers.env_stage import EnvironmentStage
from staleflow.runtime.workers.reward_stage import CompletionSink, RewardStage
from staleflow.trainers import trainer_class

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from staleflow.config import EnvConfig, RewardConfig, RolloutConfig, TrainerConfig
    from staleflow.config.lora import LoraConfig
    from staleflow.config.rollout import SpeculationOptions
    from staleflow.engines.factory import EngineOptions


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The policy's architecture (``model.config.to_dict()``), its PS layout and its
    tokenizer, as plain data. With ``lora`` (``trainer.lora``), the policy has adapters:
    ``layout`` is the adapter's (what every version carries) and ``base_layout`` the
    frozen base's, which the PS and each instance hold once."""

    hf_config: dict[str, Any]
    layout: dict[str, Any]
    tokenizer: tuple[str, str]  # ("char", alphabet) or ("hf", local path)
    eos_token_id: int
    pad_token_id: int
    lora: LoraConfig | None = None
    base_layout: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """What a rollout instance builds its engine from: the ``rollout`` section, plus the
    values the launcher derives from the dataset and the seed."""

    model: ModelSpec
    rollout: RolloutConfig
    max_seq_len: int  # longest prompt + rollout.max_response_tokens
    kv_budget_tokens: int  # rollout.kv_budget_tokens, raised to hold one whole trajectory
    seed: int
    # rollout.vllm / rollout.sglang resolved by the driver (model folder, log folder);
    # empty for the embedded engine
    engine_options: EngineOptions | None = None
    # Divided rollout (coordinator.seer): response tokens one route may add; None: off.
    chunk_tokens: int | None = None
    # eval.max_running: evaluation requests in the engine at once (rollout/eval_lane.py)
    eval_running: int = 16
    # KV tokens of finished turns the embedded engine keeps for their next turn
    # (rollout.prefix_cache_tokens; 0 for a single-turn task, which has no next turn)
    prefix_cache_tokens: int = 0

    @property
    def layout(self) -> dict[str, Any]:
        return self.model.layout


@dataclass(frozen=True, slots=True)
class EnginePlacement:
    """Where an engine runs: its instance id, the instance's placement group and the
    indices of its bundles beyond the first (which the instance's own actor holds, for TP
    workers), and the route to the PS replica it Pulls from (engines whose TP ranks pull
    their own shards need it)."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    tp_bundles: tuple[int, ...] = ()
    inst: int = 0
    pull: Any = None  # parameter_server.replicas.ReplicaRoute


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """The environment of a multi-turn task (``staleflow.envs``), for the reward workers
    that run its steps."""

    name: str  # "module:attribute" (staleflow.envs.environment_target)
    options: Mapping[str, Any]
    max_turns: int
    max_tokens: int  # the response budget, turns and observations together
    threads: int
    step_timeout_s: float = 0.0  # 0: no limit
    sandbox: bool = False  # steps in confined, killable processes (env_sandbox.py)
    sandbox_memory_mb: int = 1024


def env_spec(env: EnvConfig, task: str, budget: int) -> EnvSpec | None:
    """The environment of ``task`` (``data.task``) from the ``env`` section, its episodes
    within ``budget`` response tokens (the resolved ``rollout.max_response_tokens``); None
    for a single-turn task."""
    if task not in ENV_TASKS:
        return None
    e = env
    name = e.environment(task)
    return EnvSpec(
        environment_target(name),
        e.options(name),
        e.max_turns,
        budget,
        e.threads,
        e.step_timeout_s,
        e.sandbox,
        e.sandbox_memory_mb,
    )


@dataclass(frozen=True, slots=True)
class RewardSpec:
    reward: RewardConfig  # resolved: kind is arithmetic | exact | math_verify
    tokenizer: tuple[str, str]
    env: EnvSpec | None = None  # set: a multi-turn task, its environment scores episodes


@dataclass(frozen=True, slots=True)
class TrainerSpec:
    model: ModelSpec
    trainer: TrainerConfig
    seed: int
    resume_from: str = ""  # a run checkpoint's trainer/ folder to load first
    audit_path: str = ""  # with recovery.audit_log: where consumed trajectories are written

    @property
    def layout(self) -> dict[str, Any]:
        return self.model.layout

    @property
    def consume_timeout_s(self) -> float | None:
        return self.trainer.stall_timeout_s or None


# -- tokenizers and models ---------------------------------------------------------------


def tokenizer_spec(tokenizer: object) -> tuple[str, str]:

    if isinstance(tokenizer, CharTokenizer):
        return ("char", tokenizer.alphabet)
    if isinstance(tokenizer, HFTokenizer):
        return ("hf", tokenizer._path)
    raise TypeError(f"cannot hand a {type(tokenizer).__name__} to other processes")


def tokenizer_from_spec(spec: tuple[str, str]) -> Any:

    kind, value = spec
    return CharTokenizer(value) if kind == "char" else HFTokenizer(value)


def model_spec(
    model: PreTrainedModel, tokenizer: Tokenizer, lora: LoraConfig | None = None
) -> ModelSpec:
    """The spec of ``model``; with ``lora``, of its adapters (injected already,
    :func:`staleflow.models.lora.add_adapters`) over its base."""
    base = None
    if lora is not None:
        layout = layout_of_state_dict(lora_lib.adapter_state(model))
        base = layout_of_state_dict(lora_lib.base_state(model)).to_dict()
    else:  # a model without adapters: its base state is its whole policy state
        layout = layout_of_state_dict(lora_lib.base_state(model))
    return ModelSpec(
        hf_config=model.config.to_dict(),
        layout=layout.to_dict(),
        tokenizer=tokenizer_spec(tokenizer),
        eos_token_id=int(tokenizer.eos_id),
        pad_token_id=int(tokenizer.pad_id),
        lora=lora,
        base_layout=base,
    )


def initial_weights(
    model: PreTrainedModel, spec: ModelSpec
) -> tuple[dict[str, np.ndarray], tuple[Layout, dict[str, np.ndarray]] | None]:
    """What the driver publishes first: the policy's weights, or with LoRA its adapter and
    (the PS holds it once) the base's layout and weights."""
    if spec.lora is None or spec.base_layout is None:
        return state_dict_to_numpy(lora_lib.base_state(model)), None  # the whole policy
    base = state_dict_to_numpy(lora_lib.base_state(model))
    return state_dict_to_numpy(lora_lib.adapter_state(model)), (
        Layout.from_dict(spec.base_layout),
        base,
    )


def build_architecture(spec: ModelSpec, seed: int = 0) -> Any:
    """The model with freshly initialised weights (and adapters, with ``spec.lora``); the
    caller loads real ones."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(spec.hf_config)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(torch.float32)
    if spec.lora is not None:
        lora_lib.add_adapters(model, spec.lora, seed=seed)
    return model


# -- components --------------------------------------------------------------------------


def engine_settings(spec: RolloutSpec, seed: int) -> Any:
    """The settings every engine shares (capacity, sampling), from the rollout spec."""

    r = spec.rollout
    return EngineSettings(
        kv_budget_tokens=spec.kv_budget_tokens,
        max_running=r.max_running,
        max_seq_len=spec.max_seq_len,
        temperature=r.temperature,
        top_p=r.top_p,
        eos_token_id=spec.model.eos_token_id,
        seed=seed,
    )


def speculation_settings(options: SpeculationOptions) -> SpeculationSettings | None:
    """``rollout.speculation`` as the engine's setting (None: off)."""
    if options.method == "off":
        return None
    return SpeculationSettings(
        drafts=DraftSettings(
            scope=options.method, min_ngram=options.min_ngram, max_ngram=options.max_ngram
        ),
        max_draft=options.max_draft,
        batch_draft_tokens=options.batch_draft_tokens,
        window=options.window,
    )


def build_embedded_engine(spec: RolloutSpec, seed: int, placement: EnginePlacement) -> Any:
    """The ``embedded`` rollout backend (one CPU process; ``placement`` has no TP bundles)."""
    from dataclasses import asdict

    # torch, as above: only a rollout actor with the embedded engine loads it
    from staleflow.engines.embedded import EmbeddedEngineConfig

    config = EmbeddedEngineConfig(
        **asdict(engine_settings(spec, seed)),
        num_threads=spec.rollout.num_threads,
        prefix_cache_tokens=spec.prefix_cache_tokens,
        speculation=speculation_settings(spec.rollout.speculation),
    )
    return engine_class("embedded")(build_architecture(spec.model, seed), config)


def build_served_engine(spec: RolloutSpec, seed: int, placement: EnginePlacement) -> Any:
    """The ``vllm`` and ``sglang`` rollout backends: an engine over the model folder that
    ``spec.engine_options`` names (resolved by the driver), imported only here."""

    if spec.engine_options is None:
        raise ValueError(f"rollout.backend={spec.rollout.backend} needs resolved engine options")
    pull = placement.pull
    return build_engine(
        spec.rollout.backend,
        engine_settings(spec, seed),
        spec.engine_options,
        inst=placement.inst,
        ps_endpoint=None if pull is None else pull.endpoint,
        transport="auto" if pull is None else pull.intended,
        layout=spec.layout,
        lora=spec.model.lora,
    )


def build_embedded_trainer(
    spec: TrainerSpec,
    weights: Mapping[str, np.ndarray],
    base: Mapping[str, np.ndarray] | None = None,
) -> Any:
    """The embedded trainer over ``weights`` (with LoRA: the adapter, over ``base``)."""
    # torch, as above: only the trainer actor loads it
    from staleflow.models.state import load_policy_state

    model = build_architecture(spec.model)
    if spec.model.lora is not None:
        if base is None:
            raise ValueError("a LoRA trainer needs the base weights under its adapter")
        lora_lib.load_base_state(model, base)
        lora_lib.load_adapter_state(model, weights)
    else:
        load_policy_state(model, weights)
    # the tokenizer goes into every checkpoint, so that model.checkpoint=<it> can resume
    tokenizer = tokenizer_from_spec(spec.model.tokenizer)
    return trainer_class("embedded").from_section(
        model, spec.trainer, pad_id=spec.model.pad_token_id, seed=spec.seed, tokenizer=tokenizer
    )


@dataclass(frozen=True, slots=True)
class _Scored:
    reward: float
    error: str


def build_reward_stage(
    spec: RewardSpec,
    ts: CompletionSink,
    report: Callable[[Sequence[Rewarded]], None],
    worker_id: str | None = None,
) -> RewardStage | EnvironmentStage:

    kind = spec.reward.kind
    worker = RewardWorker(build_reward_fn(kind, spec.reward.timeout_s), name=kind)
    tokenizer = tokenizer_from_spec(spec.tokenizer)

    def score(items: Sequence[tuple[int, str, str]]) -> list[_Scored]:
        results = worker.score([RewardItem(t, text, answer) for t, text, answer in items])
        return [_Scored(r.reward, r.error) for r in results]

    stage = RewardStage(score, tokenizer.decode, ts, report, worker_id)
    if spec.env is None:
        return stage
    e = spec.env
    return EnvironmentStage(
        make_environment(e.name, **e.options),
        turn_format(tokenizer),
        EpisodeLimits(max_turns=e.max_turns, max_tokens=e.max_tokens),
        ts,  # type: ignore[arg-type]  # the TS client serves the environment calls too
        stage,
        worker_id=worker_id or "reward",
        threads=e.threads,
        step_timeout_s=e.step_timeout_s,
        sandbox=(
            SandboxedSteps(
                e.name,
                e.options,
                e.step_timeout_s,
                processes=e.threads,
                limits=Limits(cpu_s=e.step_timeout_s, memory_mb=e.sandbox_memory_mb),
            )
            if e.sandbox
            else None
        ),
    )
