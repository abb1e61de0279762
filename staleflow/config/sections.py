"""The sections of the run configuration, one per component.

Each section checks its own values in ``__post_init__``; checks that involve several
sections live in :mod:`staleflow.config.run`. Messages name the dotted key and the fix.
The ``coordinator`` section is :class:`coordinator.config.CoordinatorConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from staleflow.config.checks import (
    ACTORS_WHY,
    BATCH_TOKENS_WHY,
    MAX_ACTORS,
    MAX_BATCH_TOKENS,
    MAX_THREADS,
    MAX_WAIT_S,
    THREADS_WHY,
    WAIT_WHY,
    _help,
    require,
    require_at_least,
    require_choice,
    require_positive,
)
from staleflow.config.data import (
    DATA_TASKS as DATA_TASKS,
)
from staleflow.config.data import (
    FILE_TASKS as FILE_TASKS,
)
from staleflow.config.data import (
    DataConfig as DataConfig,
)
from staleflow.config.lora import LoraConfig
from staleflow.config.loss import LossSettings
from staleflow.config.rollout import (
    ROLLOUT_BACKENDS as ROLLOUT_BACKENDS,
)
from staleflow.config.rollout import (
    RolloutConfig as RolloutConfig,
)
from staleflow.config.rollout import (
    SGLangOptions as SGLangOptions,
)
from staleflow.config.rollout import (
    VLLMOptions as VLLMOptions,
)
from staleflow.config.walk import check_types
from staleflow.models.presets import PRESETS
from staleflow.rewards.registry import AUTO, reward_names
from staleness.bounds import MAX_HELD_TRAJECTORIES

TRAINER_BACKENDS = ("embedded", "megatron")
OFF_POLICY_MODES = ("decoupled", "tis", "none")
CAP_MODES = ("auto", "truncate", "mask")
ADVANTAGES = ("grpo", "dapo", "drgrpo")
# parameter_server.transport.TRANSPORT_NAMES, not imported: configuration stays
# importable without the transports' modules
TRANSPORTS = ("auto", "shm", "nixl", "socket")
PUSH_TRANSPORTS = ("auto", "nixl", "socket")  # to another node: no shared memory there


AUTO_PRESET = "auto"  # model.preset chosen for the task (RunConfig.builtin_preset)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The policy: a built-in model warmed up on the task, or a local HF checkpoint."""

    KEY: ClassVar[str] = "model"

    preset: str = field(
        default=AUTO_PRESET,
        metadata=_help(
            "size of the built-in model (staleflow.models.presets), or auto: micro for the "
            "built-in calculator task (the size that learns it in minutes on a CPU, "
            "docs/agentic.md), tiny otherwise; unused with a checkpoint"
        ),
    )
    checkpoint: str = field(
        default="",
        metadata=_help(
            "local Hugging Face checkpoint directory; '' = the built-in model with a "
            "supervised warm-up"
        ),
    )
    warmup_steps: int = field(
        default=1200,
        metadata=_help(
            "most supervised warm-up steps of the built-in model (it stops earlier at "
            "model.warmup_target)",
            1_000_000,
            "supervised steps of the built-in model, which reaches its target in about 1,200: a million is days",
        ),
    )
    warmup_target: float = field(
        default=0.25,
        metadata=_help(
            "stop the warm-up once its sampled validation accuracy reaches this share, so "
            "RL starts from a policy that is sometimes right; 0 = all warmup_steps",
            1.0,
            "a share of problems solved",
        ),
    )
    warmup: bool = field(
        default=True,
        metadata=_help("warm the built-in model up on solved problems before RL"),
    )
    cache_dir: str = field(
        default="",
        metadata=_help(
            "folder reused across runs for the warmed-up model; '' = $STALEFLOW_CACHE/warmup "
            "or ~/.cache/staleflow/warmup"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        if not self.checkpoint:
            require(bool(self.preset), "model.preset", self.preset, "is empty: use e.g. tiny")
            presets = _model_presets()
            if presets is not None and self.preset != AUTO_PRESET:
                require_choice("model.preset", self.preset, presets)
        require_at_least("model.warmup_steps", self.warmup_steps, 0, "steps (0 skips it)")
        require(
            0.0 <= self.warmup_target <= 1.0,
            "model.warmup_target",
            self.warmup_target,
            "is not a share: use 0 (no target) to 1, e.g. 0.25",
        )


def _model_presets() -> tuple[str, ...] | None:
    """Names of the built-in model sizes (``staleflow.models.presets`` needs no torch)."""
    return tuple(sorted(PRESETS))


@dataclass(frozen=True, slots=True)
class RewardConfig:
    """How finished responses are graded."""

    KEY: ClassVar[str] = "reward"

    kind: str = field(
        default=AUTO,
        metadata=_help(
            "auto (arithmetic for the built-in task, math_verify for datasets) | arithmetic "
            "| math_verify | exact"
        ),
    )
    workers: int = field(default=1, metadata=_help("reward workers", MAX_ACTORS, ACTORS_WHY))
    timeout_s: float = field(
        default=5.0,
        metadata=_help(
            "seconds one response may take to grade before it scores 0; 0 = no limit. "
            "Enforced by a killable child process for math_verify",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_choice("reward.kind", self.kind, (AUTO, *reward_names()))
        require_at_least("reward.workers", self.workers, 1, "worker")
        require(
            math.isfinite(self.timeout_s) and self.timeout_s >= 0,
            "reward.timeout_s",
            self.timeout_s,
            "must be >= 0 seconds (0 = no limit), e.g. 5",
        )


@dataclass(frozen=True, slots=True)
class TrainerConfig(LossSettings):
    """The training workers: the optimiser, the off-policy PPO-style loss, and where it runs.
    The loss variant, its aggregation and the reference KL are :class:`LossSettings`'s.

    The one definition of the trainer's settings: every backend (``staleflow.trainers``)
    receives this section as it is. What each rank reserves (CPUs, GPUs, node group) is
    ``resources.trainer``; the number of ranks is 1 (embedded) or ``dp x tp x pp``.
    """

    KEY: ClassVar[str] = "trainer"

    backend: str = field(
        default="embedded",
        metadata=_help(
            "embedded (PyTorch, one process) | megatron (Megatron-core ranks: gloo on CPU, "
            "NCCL on GPU)"
        ),
    )
    # measured on the default run: 1e-4 and above destabilise the warmed tiny policy
    # (3e-4 collapses it to ~0 reward), 3e-5 barely moves it in 200 steps
    lr: float = field(
        default=5e-5,
        metadata=_help(
            "AdamW learning rate",
            1.0,
            "an AdamW update moves each weight by about lr: above 1 it moves it by more than its own scale",
        ),
    )
    adam_beta1: float = field(
        default=0.9, metadata=_help("AdamW beta1, in [0, 1)", 1.0, "a decay rate, in [0, 1)")
    )
    adam_beta2: float = field(
        default=0.999, metadata=_help("AdamW beta2, in [0, 1)", 1.0, "a decay rate, in [0, 1)")
    )
    weight_decay: float = field(
        default=0.0,
        metadata=_help(
            "AdamW weight decay",
            1.0,
            "AdamW scales each weight by 1 - lr x weight_decay per update, which must stay in [0, 1]",
        ),
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata=_help(
            "gradient-norm clipping bound",
            1e6,
            "a float32 gradient norm: a bound above a million never clips",
        ),
    )
    eps_low: float = field(
        default=0.2,
        metadata=_help(
            "lower clip range: ratios below 1 - eps_low are clipped",
            1.0,
            "ratios below 1 - eps_low are clipped, and a ratio is never negative",
        ),
    )
    eps_high: float = field(
        default=0.28,
        metadata=_help(
            "upper clip range: ratios above 1 + eps_high are clipped (DAPO clip-higher)",
            100.0,
            "a clip range of ratios up to 1 + eps_high: above 100 it never clips",
        ),
    )
    off_policy: str = field(
        default="decoupled",
        metadata=_help(
            "correction for stale data: decoupled (PPO with a proximal policy) | tis "
            "(truncated importance sampling) | none"
        ),
    )
    is_cap: float = field(
        default=5.0,
        metadata=_help(
            "cap on the importance weights of the off-policy correction",
            1e6,
            "an importance weight of a million is a 14-nat logprob gap: a cap above never caps",
        ),
    )
    is_cap_mode: str = field(
        default="auto",
        metadata=_help(
            "a weight above is_cap: truncate (to the cap) | mask (drop the token) | auto "
            "(mask for decoupled, as AReaL; truncate for tis)"
        ),
    )
    advantage: str = field(
        default="grpo",
        metadata=_help(
            "group-relative advantages: grpo ((r - mean) / std) | dapo (r - mean) | drgrpo "
            "(r - mean, with Dr. GRPO's constant length normalisation: loss_agg=auto)"
        ),
    )
    micro_batch_size: int = field(
        default=32,
        metadata=_help(
            "at most this many trajectories per forward/backward pass",
            MAX_HELD_TRAJECTORIES,
            "a micro-batch is part of a step's batch, see batch_size",
        ),
    )
    micro_batch_tokens: int = field(
        default=8192,
        metadata=_help(
            "at most this many padded tokens per forward/backward pass (a longer sequence "
            "gets one of its own)",
            MAX_BATCH_TOKENS,
            BATCH_TOKENS_WHY,
        ),
    )
    updates_per_step: int = field(
        default=1,
        metadata=_help(
            "optimizer updates per training step (PPO mini-batches of the batch)",
            1024,
            "PPO mini-batches of one batch: each needs groups of its own",
        ),
    )
    num_threads: int = field(
        default=1, metadata=_help("CPU threads of each trainer process", MAX_THREADS, THREADS_WHY)
    )
    tp: int = field(
        default=1,
        metadata=_help(
            "tensor-parallel size (megatron): must divide the attention and KV heads",
            1024,
            "it must divide the attention heads, and no model has more than 1,024",
        ),
    )
    pp: int = field(
        default=1,
        metadata=_help(
            "pipeline-parallel size (megatron): stages of equal layer counts, so it must "
            "divide the model's layers; micro-batches run through Megatron's 1F1B schedule",
            1024,
            "it must divide the layers, and no model has more than 1,024",
        ),
    )
    dp: int = field(
        default=1,
        metadata=_help(
            "data-parallel size (megatron): each DP rank trains on its own groups",
            MAX_ACTORS,
            ACTORS_WHY,
        ),
    )
    ranks: int = field(
        default=0,
        metadata=_help(
            "trainer processes to start (megatron); 0 = dp x tp x pp, which it must equal",
            MAX_ACTORS,
            ACTORS_WHY,
        ),
    )
    load: str = field(
        default="",
        metadata=_help(
            "a Megatron distributed checkpoint folder (<run>/checkpoint/megatron) to start "
            "from instead of the policy's weights; any tp"
        ),
    )
    stream: bool = field(
        default=False,
        metadata=_help(
            "RolloutPipe's complete-group pipelining: forward/backward on each group of the "
            "next batch as soon as it is occupied, the update once the batch is complete "
            "(the same loss as the whole batch's); needs updates_per_step = 1"
        ),
    )
    stall_timeout_s: float = field(
        default=900.0,
        metadata=_help(
            "stop the run with an error when the trainer waits longer than this for its "
            "next batch (a wedged rollout); 0 waits forever",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require(
            math.isfinite(self.stall_timeout_s) and self.stall_timeout_s >= 0,
            "trainer.stall_timeout_s",
            self.stall_timeout_s,
            "must be >= 0 seconds (0 waits forever), e.g. 900",
        )
        require_choice("trainer.backend", self.backend, TRAINER_BACKENDS)
        require_positive("trainer.lr", self.lr, "1e-4")
        for key, beta in (
            ("trainer.adam_beta1", self.adam_beta1),
            ("trainer.adam_beta2", self.adam_beta2),
        ):
            require(0.0 <= beta < 1.0, key, beta, "is out of range: use [0, 1), e.g. 0.9")
        require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "trainer.weight_decay",
            self.weight_decay,
            "must be >= 0, e.g. 0.0 or 0.01",
        )
        require_positive("trainer.max_grad_norm", self.max_grad_norm, "1.0")
        require(
            0.0 <= self.eps_low < 1.0,
            "trainer.eps_low",
            self.eps_low,
            "is out of range: use [0, 1), e.g. 0.2",
        )
        require(
            math.isfinite(self.eps_high) and self.eps_high >= 0,
            "trainer.eps_high",
            self.eps_high,
            "must be >= 0, e.g. 0.28",
        )
        require_choice("trainer.off_policy", self.off_policy, OFF_POLICY_MODES)
        require(
            math.isfinite(self.is_cap) and self.is_cap >= 1.0,
            "trainer.is_cap",
            self.is_cap,
            "must be >= 1 (a cap below 1 would shrink even on-policy tokens), e.g. 5.0",
        )
        require_choice("trainer.is_cap_mode", self.is_cap_mode, CAP_MODES)
        require_choice("trainer.advantage", self.advantage, ADVANTAGES)
        self._check_loss()
        require_at_least("trainer.micro_batch_size", self.micro_batch_size, 1, "trajectory")
        require_at_least("trainer.micro_batch_tokens", self.micro_batch_tokens, 1, "token")
        require_at_least("trainer.updates_per_step", self.updates_per_step, 1, "update")
        require_at_least("trainer.num_threads", self.num_threads, 1, "thread")
        if self.stream:
            require(
                self.updates_per_step == 1,
                "trainer.updates_per_step",
                self.updates_per_step,
                "must be 1 with trainer.stream (a second update needs the first one's "
                "weights, which exist only once the whole batch is in): set it to 1, or "
                "trainer.stream=false",
            )
        self._check_parallelism()
        # Megatron's ranks train and Push their tensor-parallel shards of every weight;
        # adapters on its parallel linear layers (sharded like their base) are not built
        require(
            not (self.lora.enabled and self.backend == "megatron"),
            "trainer.lora.enabled",
            self.lora.enabled,
            "needs trainer.backend=embedded: the Megatron trainer has no adapters on its "
            "tensor-parallel linear layers (its ranks train and Push full shards); set "
            "trainer.backend=embedded, or trainer.lora.enabled=false to train the full "
            "weights with Megatron",
        )

    def _check_parallelism(self) -> None:
        for key in ("tp", "pp", "dp"):
            require_at_least(f"trainer.{key}", getattr(self, key), 1, "rank")
        require_at_least("trainer.ranks", self.ranks, 0, "ranks (0 = dp x tp x pp)")
        product = self.dp * self.tp * self.pp
        if self.ranks:
            fit = self.ranks // (self.tp * self.pp)
            require(
                self.ranks == product,
                "trainer.ranks",
                self.ranks,
                f"does not equal trainer.dp x trainer.tp x trainer.pp = {self.dp} x {self.tp} "
                f"x {self.pp} = {product}: "
                + (
                    f"set trainer.dp={fit}"
                    if fit * self.tp * self.pp == self.ranks and fit >= 1
                    else "set trainer.ranks=0 (= dp x tp x pp) or change tp, pp, dp"
                ),
            )
        if self.backend != "megatron":
            for key in ("tp", "pp", "dp", "ranks"):
                value = getattr(self, key)
                require(
                    value in (0, 1),
                    f"trainer.{key}",
                    value,
                    f"needs trainer.backend=megatron (the {self.backend} trainer is one "
                    "process): set trainer.backend=megatron, or drop it",
                )
            require(
                not self.load,
                "trainer.load",
                self.load,
                "is a Megatron checkpoint: set trainer.backend=megatron, or drop it",
            )


@dataclass(frozen=True, slots=True)
class PSConfig:
    """The parameter server: versioned weights between trainer and rollout instances."""

    KEY: ClassVar[str] = "parameter_server"

    transport: str = field(
        default="auto",
        metadata=_help(
            "how an instance Pulls from the PS replica on its own node (and the trainer "
            "Pushes to one on its node): auto (shared memory) | shm | nixl | socket"
        ),
    )
    push_transport: str = field(
        default="auto",
        metadata=_help(
            "how the trainer Pushes to a PS replica on another node: auto (NIXL when it "
            "starts there, else socket) | nixl | socket (TCP)"
        ),
    )
    num_slots: int = field(
        default=3,
        metadata=_help(
            "weight versions held at once (one written while others are read)",
            64,
            "each slot holds a whole copy of the policy's weights in memory",
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_choice("parameter_server.transport", self.transport, TRANSPORTS)
        require_choice("parameter_server.push_transport", self.push_transport, PUSH_TRANSPORTS)
        require_at_least(
            "parameter_server.num_slots",
            self.num_slots,
            2,
            "slots (one is readable while the next version is written)",
        )
