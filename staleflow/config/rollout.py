"""The ``rollout`` section: the rollout instances, how they sample, and the options of
each engine backend (``rollout.vllm``, ``rollout.sglang``). Messages name the dotted key
and the fix, as in :mod:`staleflow.config.sections`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from coordinator.cost_model import MEASURED_ACCEPTANCE, SpeculationProfile
from staleflow.config.checks import (
    ACTORS_WHY,
    BATCH_TOKENS_WHY,
    MAX_ACTORS,
    MAX_BATCH_TOKENS,
    MAX_NODE_GPUS,
    MAX_SEQUENCE_TOKENS,
    MAX_THREADS,
    MAX_WAIT_S,
    NODE_GPUS_WHY,
    SEQUENCE_WHY,
    THREADS_WHY,
    WAIT_WHY,
    _help,
    require,
    require_at_least,
    require_choice,
    require_positive,
)
from staleflow.config.walk import check_types

ROLLOUT_BACKENDS = ("embedded", "vllm", "sglang")
# the backends whose engines load a LoRA adapter per version (trainer.lora): each engine
# class says so with ``loads_adapters`` (tests/staleflow/engines check the two agree)
LORA_ROLLOUT_BACKENDS = ("embedded", "vllm", "sglang")
SGLANG_WEIGHT_SYNCS = ("tensor", "disk")  # staleflow.engines.sglang.config.WEIGHT_SYNCS
SPECULATION_METHODS = ("off", "group", "own")
RACE_METHODS = ("auto", "same", "group", "own", "off")  # rollout.speculation.race_method
DRAFT_WHY = "draft tokens verified in one forward: acceptance decays long before 1024 tokens"
NGRAM_WHY = "the index keeps every n-gram up to this length per token: its memory grows with it"
SPECULATION_BACKENDS = ("embedded",)  # the backends that verify drafts (docs/speculation.md)


@dataclass(frozen=True, slots=True)
class VLLMOptions:
    """rollout.backend=vllm: one in-process vLLM engine per instance (docs/engines.md).

    Its tensor-parallel size is ``rollout.tensor_parallel``, the one key that also reserves
    each rank's resources (``rollout.vllm.tensor_parallel_size`` is refused, naming it)."""

    KEY: ClassVar[str] = "rollout.vllm"

    model_path: str = field(
        default="",
        metadata=_help(
            "checkpoint folder vLLM loads the architecture from; empty: model.checkpoint, or "
            "the built-in policy saved into the run folder"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help(
            "vLLM's share of each GPU's memory (ignored on CPU)",
            1.0,
            "a share of each GPU's memory",
        ),
    )
    dtype: str = field(
        default="float32", metadata=_help("float32 | bfloat16 | float16 | auto (weights and KV)")
    )
    extra_args: str = field(
        default="",
        metadata=_help('more vllm.EngineArgs as a JSON object, e.g. {"enforce_eager": false}'),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"{self.KEY}.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "is out of range: use (0, 1]",
        )
        require_choice(f"{self.KEY}.dtype", self.dtype, ("float32", "bfloat16", "float16", "auto"))
        if self.extra_args:
            try:
                parsed = json.loads(self.extra_args)
            except ValueError:
                parsed = None
            require(
                isinstance(parsed, dict),
                f"{self.KEY}.extra_args",
                self.extra_args,
                'is not a JSON object: write e.g. {"max_num_batched_tokens": 4096}',
            )


@dataclass(frozen=True, slots=True)
class SGLangOptions:
    """rollout.backend=sglang: one sglang.launch_server per instance (docs/engines.md)."""

    KEY: ClassVar[str] = "rollout.sglang"

    model_path: str = field(
        default="",
        metadata=_help(
            "checkpoint folder the servers load; empty: model.checkpoint, or the built-in "
            "policy saved into the run folder"
        ),
    )
    tp_size: int = field(
        default=1, metadata=_help("GPUs per server (tensor parallel)", MAX_NODE_GPUS, NODE_GPUS_WHY)
    )
    mem_fraction_static: float = field(
        default=0.0,
        metadata=_help(
            "SGLang's --mem-fraction-static; 0 leaves SGLang's default",
            1.0,
            "a share of each GPU's memory",
        ),
    )
    weight_sync: str = field(
        default="tensor",
        metadata=_help(
            "tensor (each TP rank pulls from the parameter server) | disk "
            "(/update_weights_from_disk on a RAM folder)"
        ),
    )
    disk_dir: str = field(
        default="/dev/shm", metadata=_help("RAM-backed folder for weight_sync=disk")
    )
    python: str = field(
        default="", metadata=_help("interpreter with sglang installed; empty: this one")
    )
    extra_server_args: str = field(
        default="", metadata=_help("appended to each launch_server command line")
    )
    deterministic: bool = field(
        default=False,
        metadata=_help(
            "start each server with --enable-deterministic-inference: a trajectory samples "
            "the same tokens on any instance and after any resume (each request is seeded "
            "by trajectory), as coordinator.race needs; batch-invariant kernels are slower"
        ),
    )
    startup_timeout_s: float = field(
        default=900.0,
        metadata=_help("how long a server may take to become healthy", MAX_WAIT_S, WAIT_WHY),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_at_least(f"{self.KEY}.tp_size", self.tp_size, 1, "GPU")
        require(
            0.0 <= self.mem_fraction_static < 1.0,
            f"{self.KEY}.mem_fraction_static",
            self.mem_fraction_static,
            "is out of range: use [0, 1) (0: SGLang's default)",
        )
        require_choice(f"{self.KEY}.weight_sync", self.weight_sync, SGLANG_WEIGHT_SYNCS)
        require_positive(f"{self.KEY}.startup_timeout_s", self.startup_timeout_s, "900")


@dataclass(frozen=True, slots=True)
class SpeculationOptions:
    """rollout.speculation: lossless speculative decoding from model-free drafts
    (docs/speculation.md); off by default."""

    KEY: ClassVar[str] = "rollout.speculation"

    method: str = field(
        default="off",
        metadata=_help(
            "off | group (drafts from the responses of the trajectory's group and its own "
            "history) | own (its own prompt and response only)"
        ),
    )
    max_draft: int = field(
        default=8,
        metadata=_help("draft tokens one trajectory verifies per step", 1024, DRAFT_WHY),
    )
    batch_draft_tokens: int = field(
        default=32,
        metadata=_help(
            "draft tokens the whole running batch verifies per step: a trajectory drafts "
            "min(max_draft, this // running), long in the tail, none in a full batch",
            MAX_BATCH_TOKENS,
            BATCH_TOKENS_WHY,
        ),
    )
    min_ngram: int = field(
        default=2,
        metadata=_help("shortest context suffix matched in the group", 1024, NGRAM_WHY),
    )
    max_ngram: int = field(
        default=6,
        metadata=_help("longest context suffix matched in the group", 1024, NGRAM_WHY),
    )
    acceptance: float | None = field(
        default=None,
        metadata=_help(
            "the coordinator's prior per-token acceptance of draft tokens, in [0, 1), until "
            "the engines' counters measure it (null: the one measured for the method, "
            "coordinator.cost_model.MEASURED_ACCEPTANCE)",
            0.999,
            "a token accepted with certainty makes every draft free: the cost model holds "
            "measured acceptance below 0.999 too",
            0.0,
        ),
    )
    race_method: str = field(
        default="auto",
        metadata=_help(
            "draft method of a tail-race copy (fastest-of-N over draft methods, SpecActor "
            "4.2): auto (group: an own run's copies draft from the group, a group run's stay "
            "on group, which own-history drafts never beat in bench_speculation "
            "--race-methods) | same (the original's) | group | own | off; every method "
            "samples the same tokens, only the speed differs"
        ),
    )
    window: bool = field(
        default=False,
        metadata=_help(
            "a per-trajectory draft window following its own acceptance (halved on a "
            "rejection, doubled on a draft accepted whole, within the batch rule)"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_choice(f"{self.KEY}.method", self.method, SPECULATION_METHODS)
        require_choice(f"{self.KEY}.race_method", self.race_method, RACE_METHODS)
        for name in ("max_draft", "batch_draft_tokens", "min_ngram", "max_ngram"):
            require_at_least(f"{self.KEY}.{name}", getattr(self, name), 1, "token")
        require(
            self.min_ngram <= self.max_ngram,
            f"{self.KEY}.min_ngram",
            self.min_ngram,
            f"exceeds max_ngram={self.max_ngram}: lower it or raise max_ngram",
        )
        a = self.acceptance
        require(
            a is None or 0.0 <= a < 1.0,
            f"{self.KEY}.acceptance",
            a,
            "must be in [0, 1) (a per-token probability): use e.g. 0.8, or null for the measured one",
        )

    def profile(self) -> SpeculationProfile | None:
        """What the coordinator's cost model knows of this speculation before the engines'
        counters measure the acceptance (None: off): the engines' draft-length rule and
        the configured acceptance, or the one measured for the method."""
        if self.method == "off":
            return None
        acceptance = self.acceptance
        if acceptance is None:
            acceptance = MEASURED_ACCEPTANCE[self.method]
        return SpeculationProfile(acceptance, self.max_draft, self.batch_draft_tokens)

    def race_copy_method(self) -> str | None:
        """The draft method a tail-race copy runs with; None: the engine's (the original's,
        or speculation off, where a request's method is ignored)."""
        if self.method == "off":
            return None
        # auto: grouped drafts hold the own history too, and own-history drafts were never
        # faster than grouped ones for a straggler (docs/speculation.md, fastest-of-N)
        method = "group" if self.race_method == "auto" else self.race_method
        return None if method in ("same", self.method) else method


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """The rollout instances and how they sample."""

    KEY: ClassVar[str] = "rollout"

    backend: str = field(
        default="embedded",
        metadata=_help("embedded (CPU, in process) | vllm (in process; CPU or GPU) | sglang (GPU)"),
    )
    instances: int = field(default=2, metadata=_help("rollout instances", MAX_ACTORS, ACTORS_WHY))
    tensor_parallel: int = field(
        default=1,
        metadata=_help(
            "TP ranks of one instance, all on one node (each asks resources.rollout's "
            "cpus and gpus)",
            MAX_NODE_GPUS,
            NODE_GPUS_WHY,
        ),
    )
    temperature: float = field(
        default=1.0,
        metadata=_help(
            "sampling temperature (> 0)",
            100.0,
            "logits are divided by it: above 100 sampling is uniform over the vocabulary to float32 precision",
        ),
    )
    top_p: float = field(
        default=1.0,
        metadata=_help("nucleus sampling mass, in (0, 1]", 1.0, "a share of the probability mass"),
    )
    max_response_tokens: int = field(
        default=32,
        metadata=_help("a response stops at this many tokens", MAX_SEQUENCE_TOKENS, SEQUENCE_WHY),
    )
    kv_budget_tokens: int = field(
        default=16384,
        metadata=_help(
            "KV-cache capacity of one instance, in tokens (vLLM's cache is sized to it; "
            "SGLang sizes its own)",
            MAX_BATCH_TOKENS,
            BATCH_TOKENS_WHY,
        ),
    )
    max_running: int = field(
        default=64,
        metadata=_help(
            "trajectories an instance decodes at once",
            65_536,
            "sequences decoded in one batch: vLLM's default is 256, SGLang's a few thousand",
        ),
    )
    num_threads: int = field(
        default=1,
        metadata=_help("CPU threads of one embedded instance (torch)", MAX_THREADS, THREADS_WHY),
    )
    prefix_cache_tokens: int = field(
        default=8192,
        metadata=_help(
            "multi-turn tasks, embedded engine: KV tokens of finished turns an instance keeps "
            "for their trajectory's next turn (0: re-prefill every turn)",
            MAX_BATCH_TOKENS,
            BATCH_TOKENS_WHY,
        ),
    )
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        require_at_least("rollout.instances", self.instances, 1, "rollout instance")
        require_at_least("rollout.tensor_parallel", self.tensor_parallel, 1, "rank")
        require_positive("rollout.temperature", self.temperature, "1.0 (RL needs sampling)")
        require(0.0 < self.top_p <= 1.0, "rollout.top_p", self.top_p, "is out of range: use (0, 1]")
        require_at_least("rollout.max_response_tokens", self.max_response_tokens, 1, "token")
        require_at_least("rollout.kv_budget_tokens", self.kv_budget_tokens, 1, "token")
        require_at_least("rollout.max_running", self.max_running, 1, "trajectory")
        require_at_least("rollout.num_threads", self.num_threads, 1, "thread")
        require_at_least("rollout.prefix_cache_tokens", self.prefix_cache_tokens, 0, "token")
        require(
            self.speculation.method == "off" or self.backend in SPECULATION_BACKENDS,
            "rollout.speculation.method",
            self.speculation.method,
            f"needs rollout.backend in {SPECULATION_BACKENDS} (rollout.backend="
            f"{self.backend} does not verify drafts yet): set it to off",
        )
