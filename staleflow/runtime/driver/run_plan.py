"""The run plan: a launch's configuration resolved once, in the driver, into the typed
records its parts are built from.

:func:`plan_run` is the one place that reads the whole :class:`~staleflow.config.RunConfig`
(besides ``launch`` and the CLI, which hand it here, and the run folder and the trackers,
which record it whole): it makes the ``auto`` choices explicit (``RunConfig.resolved``),
plans the control plane with the engines' KV budget and the placement request, and keeps
each resolved section. Everything below it
takes the record or the section it reads, never the configuration
(``tests/staleflow/runtime/driver/test_run_plan.py`` holds that line).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from coordinator.config import CoordinatorConfig, CostModelConfig
from staleflow.config import (
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    PSConfig,
    RecoveryConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from staleflow.config.env import ENV_TASKS
from staleflow.runtime.backends import check_backend_names
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.placement.plan import PlacementRequest, plan_placement
from staleflow.runtime.workers.specs import EnvSpec, env_spec
from trajectory_server.types import TrajectoryServerConfig


@dataclass(frozen=True, slots=True)
class TaskPlan:
    """Where the prompts, the environment of a multi-turn task and the held-out set come
    from (``data``, ``env``, ``eval``), with the run's ``seed`` and ``checkpoint``
    (``model.checkpoint``: the tokenizer's folder unless ``data.tokenizer`` names one)."""

    data: DataConfig
    env: EnvConfig
    eval: EvalConfig
    seed: int
    checkpoint: str = ""


@dataclass(frozen=True, slots=True)
class RunPlan:
    """A run's configuration, resolved once (see the module docstring)."""

    # the resolved configuration as a whole: only what records it whole reads it
    # (config.yaml in the run folder, the trackers' config); every part reads its section
    config: RunConfig
    task: TaskPlan
    control: ControlConfig  # the staleness manager's and the coordinator's sections
    trajectory_server: TrajectoryServerConfig
    placement: PlacementRequest
    model: ModelConfig
    rollout: RolloutConfig  # resolved: an environment task's response budget
    reward: RewardConfig  # resolved: kind is never auto
    trainer: TrainerConfig  # resolved: loss_norm_len
    parameter_server: PSConfig
    resources: ResourcesConfig
    recovery: RecoveryConfig
    coordinator: CoordinatorConfig  # as configured (the control plane's is ``control``)
    steps: int
    tracking: str  # the trackers, comma-separated ('' none)
    tracking_project: str

    @property
    def seed(self) -> int:
        return self.task.seed

    @property
    def eta(self) -> int:
        return self.control.staleness.eta

    @property
    def batch_size(self) -> int:
        return self.control.staleness.batch_size

    @property
    def address(self) -> str:
        """The Ray cluster the run joins ('' starts a local one)."""
        return self.placement.address

    def environment(self) -> EnvSpec | None:
        """The environment of a multi-turn task for the reward workers (None: single-turn),
        its episodes within the resolved response budget. Asked when the workers start,
        not when the plan is built: ``preflight`` refuses an unknown ``env.name`` first,
        naming the key."""
        return env_spec(self.task.env, self.task.data.task, self.rollout.max_response_tokens)


def plan_run(cfg: RunConfig) -> RunPlan:
    """The run plan of ``cfg``: resolved once; it reads no file and joins nothing. Raises
    :class:`LaunchError` for a backend ``launch`` cannot build (its trainer's ranks size
    the placement)."""
    check_backend_names(cfg.rollout.backend, cfg.trainer.backend)
    cfg = cfg.resolved()  # each component gets its section with auto choices made
    rollout = cfg.rollout
    placement = PlacementRequest(
        plan_placement(cfg.resources, rollout, cfg.trainer, cfg.reward),
        cfg.address,
        # a local Ray keeps room for two more rollout instances (staleflow scale)
        spare_cpus=2 * rollout.tensor_parallel * cfg.resources.rollout.cpus,
    )
    return RunPlan(
        config=cfg,
        task=TaskPlan(cfg.data, cfg.env, cfg.eval, cfg.seed, cfg.model.checkpoint),
        control=control_config(cfg),
        trajectory_server=cfg.trajectory_server_config(),
        placement=placement,
        model=cfg.model,
        rollout=rollout,
        reward=cfg.reward,
        trainer=cfg.trainer,
        parameter_server=cfg.parameter_server,
        resources=cfg.resources,
        recovery=cfg.recovery,
        coordinator=cfg.coordinator,
        steps=cfg.steps,
        tracking=cfg.tracking,
        tracking_project=cfg.tracking_project,
    )


def control_config(cfg: RunConfig) -> ControlConfig:
    """The staleness manager's and the coordinator's sections of a resolved ``cfg``; the
    coordinator plans with the engines' real KV budget unless the config names one, and
    for the rollout's response cap."""

    coordinator = cfg.coordinator.for_responses(cfg.rollout.max_response_tokens)
    cost = coordinator.cost_model
    if isinstance(cost, CostModelConfig) and cost.kv_budget is None:
        budget = float(cfg.rollout.kv_budget_tokens)
        coordinator = replace(coordinator, cost_model=replace(cost, kv_budget=budget))
    return ControlConfig(
        cfg.staleness_config(),
        coordinator,
        checkpoint_every=cfg.checkpoint_every,
        eval_every=cfg.eval.every if cfg.eval.during_training else 0,
        sampling=cfg.sampling_config(),
        tool_waits=cfg.data.task in ENV_TASKS,
        # vLLM's prefix caching (rollout.vllm, on by default) and SGLang's radix cache
        # keep a finished turn's KV; the embedded engine with its prefix store
        prefix_cache=cfg.data.task in ENV_TASKS
        and (cfg.rollout.backend in ("vllm", "sglang") or cfg.rollout.prefix_cache_tokens > 0),
        speculation=cfg.rollout.speculation.profile(),
        race_draft_method=cfg.rollout.speculation.race_copy_method(),
    )
