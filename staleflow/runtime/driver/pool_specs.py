"""The specs the rollout and trainer pools are built from, out of the run plan
(``staleflow.runtime.driver.run_plan``) and what the driver prepared (the policy, the
prompts, the run folder); ``staleflow.runtime.driver.run`` starts the pools with them. The
control plane's section is the plan's own (``RunPlan.control``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from staleflow.config.env import ENV_TASKS
from staleflow.engines.factory import engine_options
from staleflow.runfolder.writer import AUDIT
from staleflow.runtime.workers.specs import ModelSpec, RolloutSpec, TrainerSpec

if TYPE_CHECKING:
    from torch import nn

    from staleflow.config import TrainerConfig
    from staleflow.data import PromptDataset
    from staleflow.data.tokenizer import Tokenizer
    from staleflow.runtime.driver.run_plan import RunPlan


def rollout_spec(
    plan: RunPlan,
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

    r = plan.rollout
    prompts = [dataset] if heldout is None else [dataset, heldout]
    longest = max(int(d.prompt_lengths.max()) for d in prompts) + r.max_response_tokens
    options = None
    if r.backend != "embedded":
        options = engine_options(
            r, checkpoint=plan.model.checkpoint, run_dir=run_dir, model=policy, tokenizer=tokenizer
        )
    return RolloutSpec(
        model=model,
        rollout=r,
        max_seq_len=longest,
        kv_budget_tokens=max(r.kv_budget_tokens, longest),
        seed=plan.seed,
        engine_options=options,
        chunk_tokens=plan.coordinator.seer.chunk,
        eval_running=plan.task.eval.max_running,
        prefix_cache_tokens=r.prefix_cache_tokens if plan.task.data.task in ENV_TASKS else 0,
    )


def trainer_spec(
    trainer: TrainerConfig,
    model: ModelSpec,
    run_dir: Path,
    *,
    seed: int,
    audit_log: bool = False,
    resume_from: str = "",
) -> TrainerSpec:
    """The trainer pool's spec: the ``trainer`` section with the policy's ``model``; with
    ``audit_log`` (``recovery.audit_log``) it writes the batch audit into ``run_dir``."""

    return TrainerSpec(
        model=model,
        trainer=trainer,
        seed=seed,
        resume_from=resume_from,
        audit_path=str(run_dir / AUDIT) if audit_log else "",
    )
