"""The section each pool of a run is built from, taken from the run's configuration
(``staleflow.runtime.driver.run`` starts the pools with them): the control plane's, the
rollout instances' spec and the trainer's spec."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.config import CostModelConfig
from coordinator.cost_model import MEASURED_ACCEPTANCE, SpeculationProfile
from staleflow.config import RunConfig
from staleflow.config.env import ENV_TASKS
from staleflow.config.rollout import SpeculationOptions
from staleflow.engines.factory import engine_options
from staleflow.runfolder.writer import AUDIT
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.workers.specs import ModelSpec, RolloutSpec, TrainerSpec

if TYPE_CHECKING:
    from torch import nn

    from staleflow.data import PromptDataset
    from staleflow.data.tokenizer import Tokenizer


def control_config(cfg: RunConfig) -> ControlConfig:
    """The staleness manager's and the coordinator's sections; the coordinator plans with
    the engines' real KV budget unless the config names one, and for the rollout's
    response cap."""

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
        speculation=speculation_prior(cfg.rollout.speculation),
        race_draft_method=cfg.rollout.speculation.race_copy_method(),
    )


def speculation_prior(options: SpeculationOptions) -> SpeculationProfile | None:
    """What the coordinator's cost model knows of ``rollout.speculation`` before the
    engines' counters measure the acceptance (None: off): the engines' draft-length rule
    and the configured acceptance, or the one measured for the method."""
    if options.method == "off":
        return None
    acceptance = options.acceptance
    if acceptance is None:
        acceptance = MEASURED_ACCEPTANCE[options.method]
    return SpeculationProfile(acceptance, options.max_draft, options.batch_draft_tokens)


def rollout_spec(
    cfg: RunConfig,
    model: ModelSpec,
    dataset: PromptDataset,
    *,
    run_dir: Path,
    policy: nn.Module | None = None,
    tokenizer: Tokenizer | None = None,
    heldout: PromptDataset | None = None,
) -> RolloutSpec:
    """The rollout pool's spec; for vLLM / SGLang it resolves their options once, here in
    the driver (the model folder they load: ``model.checkpoint``, or ``policy`` saved into
    the run folder; the folder for their logs). The engines hold the longest prompt of the
    run's prompts and of its ``heldout`` set, with a whole response."""

    r = cfg.rollout
    prompts = [dataset] if heldout is None else [dataset, heldout]
    longest = max(int(d.prompt_lengths.max()) for d in prompts) + r.max_response_tokens
    options = None
    if r.backend != "embedded":
        options = engine_options(
            r, checkpoint=cfg.model.checkpoint, run_dir=run_dir, model=policy, tokenizer=tokenizer
        )
    return RolloutSpec(
        model=model,
        rollout=r,
        max_seq_len=longest,
        kv_budget_tokens=max(r.kv_budget_tokens, longest),
        seed=cfg.seed,
        engine_options=options,
        chunk_tokens=cfg.coordinator.seer.chunk,
        eval_running=cfg.eval.max_running,
        prefix_cache_tokens=r.prefix_cache_tokens if cfg.data.task in ENV_TASKS else 0,
    )


def trainer_spec(
    cfg: RunConfig, model: ModelSpec, run_dir: Path, resume_from: str = ""
) -> TrainerSpec:

    return TrainerSpec(
        model=model,
        trainer=cfg.trainer,
        seed=cfg.seed,
        resume_from=resume_from,
        audit_path=str(run_dir / AUDIT) if cfg.recovery.audit_log else "",
    )
