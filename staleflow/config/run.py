"""The top level of the configuration of ``staleflow launch``, and the checks across
sections."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from coordinator.config import ConfigError, CoordinatorConfig, CostModelConfig
from staleflow.config.checks import INT32_MAX, STEPS_WHY
from staleflow.config.env import (
    CALCULATOR_PRESET,
    CALCULATOR_RESPONSE_TOKENS,
    CALCULATOR_TRAINER_LR,
    DEFAULT_PRESET,
    ENV_RESPONSE_TOKENS,
    ENV_TASKS,
    EnvConfig,
)
from staleflow.config.evaluation import EvalConfig
from staleflow.config.loss import architecture_mismatch
from staleflow.config.recovery import RecoveryConfig
from staleflow.config.resources import ResourcesConfig
from staleflow.config.rollout import LORA_ROLLOUT_BACKENDS
from staleflow.config.sections import (
    AUTO_PRESET,
    FILE_TASKS,
    DataConfig,
    ModelConfig,
    PSConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    _help,
    require,
    require_at_least,
)
from staleflow.config.walk import check_tree_bounds, check_types
from staleflow.control.dynamic_sampling import SamplingConfig
from staleflow.data.synthetic import ArithmeticConfig
from staleflow.models.presets import PRESETS
from staleflow.rewards.registry import resolve_reward_kind
from staleflow.tracking import TrackerError, parse_trackers
from staleness import StalenessConfig
from staleness.bounds import (
    ETA_WHY,
    HELD_WHY,
    MAX_ETA,
    MAX_HELD_TRAJECTORIES,
    MAX_REDUNDANCY,
    config_problem,
)
from trajectory_server.types import TrajectoryServerConfig

if TYPE_CHECKING:
    from staleness import StalenessConfig
    from trajectory_server.types import TrajectoryServerConfig

REDUNDANCY_WHY = "a ratio r runs floor(n x (1 + r)) members for n needed: 16 runs 17x the work"

# The embedded default (a few-million-parameter model on CPU) steps in milliseconds, so
# the coordinator cycles faster than CoordinatorConfig's cluster default of 1 s. No cost
# model has been fitted for it; the preset's coefficients are kept (only their ratios
# steer routing), with the KV budget of one embedded instance (rollout.kv_budget_tokens).
EMBEDDED_PERIOD_S = 0.2
EMBEDDED_KV_BUDGET = 16384


def _embedded_coordinator() -> CoordinatorConfig:
    return CoordinatorConfig(
        period_s=EMBEDDED_PERIOD_S,
        cost_model=CostModelConfig(kv_budget=float(EMBEDDED_KV_BUDGET)),
    )


_NAME = re.compile(r"[A-Za-z0-9._-]*")


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything ``staleflow launch`` needs; the defaults run the built-in arithmetic task
    on one CPU machine with embedded backends. Each component receives its own section."""

    eta: int = field(
        default=3,
        metadata=_help("staleness bound: 0 is synchronous on-policy RL", MAX_ETA, ETA_WHY),
    )
    steps: int = field(default=200, metadata=_help("training steps", INT32_MAX, STEPS_WHY))
    seed: int = field(
        default=0,
        metadata=_help(
            "seed of sampling, data order and init",
            2**62,
            "the embedded engine keys its draws by it as an int64, and the evaluation and "
            "the data add offsets to it",
        ),
    )
    run_dir: str = field(
        default="runs", metadata=_help("parent folder; each run gets a timestamped subfolder")
    )
    name: str = field(default="", metadata=_help("run name, appended to its folder's name"))
    address: str = field(
        default="",
        metadata=_help(
            "Ray cluster to run on: auto (the cluster this node belongs to) | host:port | "
            "ray://host:port; '' = start a local Ray instance"
        ),
    )
    # 32 x 8: at 8 groups a step the default run's rollout idled three quarters of the
    # time and the gradient was too noisy to improve the tiny policy (docs/launch.md)
    batch_size: int = field(
        default=32,
        metadata=_help("groups per training step", MAX_HELD_TRAJECTORIES, HELD_WHY),
    )
    group_size: int = field(
        default=8,
        metadata=_help("trajectories per group (G)", MAX_HELD_TRAJECTORIES, HELD_WHY),
    )
    group_redundancy: float = field(
        default=0.0,
        metadata=_help(
            "extra trajectories per group, as a share of G (in [0, 16))",
            MAX_REDUNDANCY,
            REDUNDANCY_WHY,
        ),
    )
    batch_redundancy: float = field(
        default=0.0,
        metadata=_help(
            "extra groups per staleness buffer, as a share of batch_size",
            MAX_REDUNDANCY,
            REDUNDANCY_WHY,
        ),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=_help(
            "save the run's state every N steps (staleflow launch --resume continues from "
            "it); 0 = only when the run stops or ends",
            INT32_MAX,
            STEPS_WHY,
        ),
    )
    dashboard: bool = field(
        default=True,
        metadata=_help(
            "serve the REST dashboard from the driver while training (FastAPI and uvicorn, "
            "part of the default install; false turns it off)"
        ),
    )
    dashboard_port: int = field(
        default=8266,
        metadata=_help(
            "port of the dashboard on 127.0.0.1; if taken, a free one is used and printed "
            "(8265 is Ray's own dashboard)",
            65535,
            "a TCP port number has 16 bits",
        ),
    )
    tracking: str = field(
        default="",
        metadata=_help(
            "experiment trackers, comma-separated: tensorboard | wandb | mlflow (several at "
            "once; each writes under <run folder>/tracking/); '' = none (metrics.jsonl is "
            "always written)"
        ),
    )
    tracking_project: str = field(
        default="staleflow",
        metadata=_help("the W&B project and the MLflow experiment of the run's trackers"),
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parameter_server: PSConfig = field(default_factory=PSConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    coordinator: CoordinatorConfig = field(default_factory=_embedded_coordinator)

    # Keys that were replaced: the message says which key to use instead.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        # one tensor-parallel setting: the generic key sizes vLLM's TP and reserves each
        # rank's resources; two keys could disagree (issue 32)
        "rollout.vllm.tensor_parallel_size": (
            "the tensor-parallel size of every backend is rollout.tensor_parallel (vLLM's "
            "included; it also reserves resources.rollout for each rank): set "
            "rollout.tensor_parallel instead"
        ),
    }
    # Keys that were renamed and are still read under their old name (a saved config.yaml
    # of an earlier run resumes as it was), with a warning naming the new one.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        # the held-out set got its own section with the evaluation during training (#37)
        "eval_problems": "eval.problems",
    }

    def __post_init__(self) -> None:
        check_types(self, "")
        # the staleness protocol's own bounds (staleness.bounds), so the staleness manager
        # and the trajectory server accept whatever passes here
        problem = config_problem(
            self.eta, self.batch_size, self.group_size, self.batch_redundancy, self.group_redundancy
        )
        if problem is not None:
            raise ConfigError(problem)
        require_at_least("steps", self.steps, 1, "training step")
        require(self.seed >= 0, "seed", self.seed, "is negative: use a seed >= 0")
        require_at_least("checkpoint_every", self.checkpoint_every, 0, "steps (0 = at the end)")
        require(
            1 <= self.dashboard_port <= 65535,
            "dashboard_port",
            self.dashboard_port,
            "is not a TCP port: use 1 to 65535, e.g. 8266",
        )
        require(
            bool(_NAME.fullmatch(self.name)),
            "name",
            self.name,
            "is not usable in a folder name: use letters, digits, '.', '_' and '-'",
        )
        require(bool(self.run_dir), "run_dir", self.run_dir, "is empty: use e.g. runs")
        try:
            parse_trackers(self.tracking)
        except TrackerError as exc:
            raise ConfigError(str(exc)) from None
        require(
            bool(self.tracking_project.strip()),
            "tracking_project",
            self.tracking_project,
            "is empty: name the W&B project / MLflow experiment, e.g. staleflow",
        )
        # every numeric key's declared bounds (the "max" of its metadata), NaN and
        # infinities too: after each section's own checks (more specific messages), before
        # the checks across sections (which would compare an absurd value with another)
        check_tree_bounds(self)
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        data, model, rollout = self.data, self.model, self.rollout
        if data.task in FILE_TASKS:
            require(
                bool(data.path),
                "data.path",
                data.path,
                f"is required for data.task={data.task}: set data.path=/path/to/train.jsonl "
                "(or .parquet)",
            )
            require(
                bool(model.checkpoint),
                "model.checkpoint",
                model.checkpoint,
                f"is required for data.task={data.task}: the built-in model only knows "
                "arithmetic; set model.checkpoint=/path/to/a/local/hf/checkpoint",
            )
        elif data.task == "env":
            self._check_env_task()
        elif data.path:
            raise ConfigError(
                f"data.path={data.path!r} is set but data.task={data.task} does not read files: "
                "set data.task to jsonl, parquet, gsm8k, dapo, hf or env, or drop data.path"
            )
        if self.env.name and data.task != "env":
            raise ConfigError(
                f"env.name={self.env.name!r} is set but data.task={data.task}: env.name is the "
                "environment of data.task=env; set data.task=env, or drop env.name"
            )
        if data.tokenizer and not model.checkpoint:
            raise ConfigError(
                f"data.tokenizer={data.tokenizer!r} replaces the tokenizer of model.checkpoint, "
                "which is not set: set model.checkpoint too, or drop data.tokenizer"
            )
        # (a vLLM/SGLang rollout of the built-in policy loads it from the run folder; the
        # megatron trainer builds its model from the policy's HF config, the built-in too)
        if rollout.backend == "embedded":
            require(
                rollout.tensor_parallel == 1,
                "rollout.tensor_parallel",
                rollout.tensor_parallel,
                "needs a tensor-parallel engine: the embedded engine runs in one process; "
                "use rollout.tensor_parallel=1, or rollout.backend=vllm or sglang",
            )
        if rollout.backend in ("embedded", "vllm"):  # both size their KV cache to it
            require(
                rollout.kv_budget_tokens >= rollout.max_response_tokens + 1,
                "rollout.kv_budget_tokens",
                rollout.kv_budget_tokens,
                "cannot hold even one trajectory: raise it above rollout.max_response_tokens "
                f"plus the prompt (max_response_tokens={rollout.max_response_tokens})",
            )
        if (
            self.coordinator.race.enabled
            and rollout.backend == "sglang"
            and not rollout.sglang.deterministic
        ):
            # a copy must sample the original's tokens (runtime/controller/races.py): the embedded
            # and vLLM engines key their draws by (seed, trajectory, token index); SGLang
            # by (seed, position), but only with deterministic inference on
            raise ConfigError(
                "coordinator.race.enabled=True with rollout.backend=sglang: the tail race "
                "needs copies that sample the original's tokens, which SGLang does only with "
                "deterministic inference; set rollout.sglang.deterministic=true (slower "
                "kernels), or set coordinator.race.enabled=false"
            )
        ref = self.trainer.ref.path
        if ref and model.checkpoint:  # the built-in policy's: the trainer checks it
            mismatch = architecture_mismatch(ref, model.checkpoint)
            require(
                mismatch is None,
                "trainer.ref.path",
                ref,
                f"holds another architecture than model.checkpoint ({mismatch}): set it to a "
                "model folder of the policy's architecture (e.g. a checkpoint of this run or of "
                "model.checkpoint), or drop it to use the initial policy",
            )
        self._check_eval()
        if self.trainer.lora.enabled:
            require(
                rollout.backend in LORA_ROLLOUT_BACKENDS,
                "rollout.backend",
                rollout.backend,
                "cannot load a LoRA adapter per version (trainer.lora.enabled=true): use "
                f"rollout.backend={' or '.join(LORA_ROLLOUT_BACKENDS)}, or "
                "trainer.lora.enabled=false to train and Push the full weights",
            )
        if not model.checkpoint:
            self._check_builtin_context()

    def _check_env_task(self) -> None:
        """data.task=env: an environment, its problems and a policy that can read them
        (the environment itself and the file's columns are checked before the launch
        starts anything: ``staleflow.runtime.driver.env_task``)."""
        require(
            bool(self.env.name),
            "env.name",
            self.env.name,
            "is required for data.task=env: name the environment, registered or "
            "module:attribute, e.g. env.name=mypkg.envs:MyEnv",
        )
        require(
            bool(self.data.path),
            "data.path",
            self.data.path,
            "is required for data.task=env: the environment's problems, one per row (.jsonl, "
            ".parquet, or a Hugging Face datasets folder or files)",
        )
        require(
            bool(self.model.checkpoint),
            "model.checkpoint",
            self.model.checkpoint,
            "is required for data.task=env: the built-in model only knows the built-in tasks; "
            "set model.checkpoint=/path/to/a/local/hf/checkpoint",
        )

    def _check_eval(self) -> None:
        ev, task = self.eval, self.data.task
        if task in ENV_TASKS:
            require(
                not ev.path and not ev.every,
                "eval.every" if ev.every else "eval.path",
                ev.every or ev.path,
                f"is not supported with data.task={task}: a multi-turn episode needs its "
                "environment, which only the reward workers run; set eval.every=0 and "
                "eval.path=''",
            )
        elif task != "arithmetic":
            require(
                bool(ev.path) or not ev.every,
                "eval.path",
                ev.path,
                f"is required for eval.every={ev.every} with data.task={task}: only the "
                "built-in task has its own held-out problems; set eval.path=/path/to/"
                "test.jsonl (or .parquet, or a datasets folder), or eval.every=0",
            )

    def builtin_preset(self) -> str:
        """``model.preset`` with ``auto`` made explicit: ``CALCULATOR_PRESET`` for the
        built-in calculator task on the built-in model, ``tiny`` otherwise."""
        if self.model.preset != AUTO_PRESET:
            return self.model.preset
        if self.data.task == "calculator" and not self.model.checkpoint:
            return CALCULATOR_PRESET
        return DEFAULT_PRESET

    def _check_builtin_context(self) -> None:
        preset = self.builtin_preset()
        limit = PRESETS[preset].max_position_embeddings
        require(
            self.rollout.max_response_tokens < limit,
            "rollout.max_response_tokens",
            self.rollout.max_response_tokens,
            f"does not fit the {preset} model's {limit}-token context with a prompt: lower it",
        )

    def resolved(self) -> RunConfig:
        """This config with ``auto`` choices that depend on other sections made explicit
        (``reward.kind``, ``trainer.loss_norm_len``), so each component can be handed its
        own section alone. An environment task's response budget left at the default (sized
        for one arithmetic answer) becomes the budget of its multi-turn episodes
        (``ENV_RESPONSE_TOKENS``). ``model.preset=auto`` becomes :meth:`builtin_preset`; for
        the calculator task that is ``CALCULATOR_PRESET``, with ``CALCULATOR_RESPONSE_TOKENS``
        as that budget (all its context holds) and, left at its default, the learning
        rate ``CALCULATOR_TRAINER_LR``."""
        out = self
        kind = resolve_reward_kind(self.reward.kind, self.data.task)
        if kind != self.reward.kind:
            out = replace(out, reward=replace(out.reward, kind=kind))
        builtin = self.data.task == "calculator" and not self.model.checkpoint
        if self.model.preset == AUTO_PRESET:
            out = replace(out, model=replace(out.model, preset=self.builtin_preset()))
            lr_default = TrainerConfig.__dataclass_fields__["lr"].default
            if out.model.preset == CALCULATOR_PRESET and builtin and self.trainer.lr == lr_default:
                out = replace(out, trainer=replace(out.trainer, lr=CALCULATOR_TRAINER_LR))
        default = RolloutConfig.__dataclass_fields__["max_response_tokens"].default
        if self.data.task in ENV_TASKS and self.rollout.max_response_tokens == default:
            tokens = ENV_RESPONSE_TOKENS
            if builtin and out.model.preset == CALCULATOR_PRESET:
                # what micro's positions leave after the level's longest prompt
                room = PRESETS[CALCULATOR_PRESET].max_position_embeddings - _longest_prompt(
                    ArithmeticConfig.level(self.data.difficulty)
                )
                tokens = min(CALCULATOR_RESPONSE_TOKENS, room)
            out = replace(out, rollout=replace(self.rollout, max_response_tokens=tokens))
        t = out.trainer
        if t.aggregation(t.advantage) == "seq_mean_token_sum_norm" and not t.loss_norm_len:
            # Dr. GRPO's constant: the longest response the rollout may sample
            trainer = replace(t, loss_norm_len=out.rollout.max_response_tokens)
            out = replace(out, trainer=trainer)
        return out

    def staleness_config(self) -> StalenessConfig:
        """The staleness manager's configuration, from the top-level keys."""

        return StalenessConfig(
            eta=self.eta,
            batch_size=self.batch_size,
            group_size=self.group_size,
            batch_redundancy=self.batch_redundancy,
            group_redundancy=self.group_redundancy,
        )

    def sampling_config(self) -> SamplingConfig | None:
        """Dynamic sampling's settings for the control plane (None: off)."""
        t = self.trainer
        if not t.dynamic_sampling:
            return None
        return SamplingConfig(self.batch_size, t.dynamic_sampling_max_drop)

    def trajectory_server_config(self) -> TrajectoryServerConfig:
        """The trajectory server's configuration, from the top-level keys."""

        return TrajectoryServerConfig(
            eta=self.eta,
            batch_size=self.batch_size,
            group_size=self.group_size,
            group_redundancy=self.group_redundancy,
            batch_redundancy=self.batch_redundancy,
            temperature=self.rollout.temperature,
        )


def config_warnings(config: RunConfig) -> list[str]:
    """Valid but probably unintended settings, one sentence each (``load_config`` logs
    them)."""
    out = []
    if config.group_size < 2:
        out.append(
            f"group_size={config.group_size}: group-relative advantages ({config.trainer.advantage}) "
            "are 0 for a group of one, so training learns nothing; use group_size >= 2"
        )
    t = config.trainer
    if t.loss == "gspo" and max(t.eps_low, t.eps_high) > 0.01:
        out.append(
            f"trainer.loss=gspo with eps_low={t.eps_low:g}, eps_high={t.eps_high:g}: a "
            "sequence's length-normalised ratio rarely leaves such a range, so nothing is "
            "clipped; the GSPO paper uses eps_low=3e-4 eps_high=4e-4"
        )
    if t.dynamic_sampling and config.eta <= 1 and config.batch_redundancy == 0:
        out.append(
            f"trainer.dynamic_sampling at eta={config.eta} with batch_redundancy=0: a dropped "
            "group's place is refilled by a group that starts from nothing while the trainer "
            "waits; over-provision with batch_redundancy of about p / (1 - p) for a dropped "
            "share p, e.g. 0.5 when a third of the groups are uniform (docs/staleness.md)"
        )
    kv_budget = config.coordinator.cost_model.kv_budget
    if (
        config.rollout.backend in ("embedded", "vllm")
        and kv_budget is not None
        and kv_budget != config.rollout.kv_budget_tokens
    ):
        out.append(
            f"coordinator.cost_model.kv_budget={kv_budget:g} differs from "
            f"rollout.kv_budget_tokens={config.rollout.kv_budget_tokens}: the coordinator "
            "will misjudge what fits; set both to the same value"
        )
    if config.reward.kind == "arithmetic" and config.data.task != "arithmetic":
        out.append(
            f"reward.kind=arithmetic with data.task={config.data.task}: it grades the text "
            "after the last '=' exactly; math_verify (reward.kind=auto) suits math datasets"
        )
    return out


def _longest_prompt(problems: ArithmeticConfig) -> int:
    """Tokens of the longest prompt of the built-in task: bos, the operands at their
    most digits, the operators between them, and ``=``."""
    n = problems.num_operands
    return 1 + n * problems.max_digits + (n - 1) + 1
