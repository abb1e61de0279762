"""``staleflow launch``: one real, fully disaggregated, staleness-bounded RL run.

The driver resolves the configuration once into the run plan (``run_plan``: every part
below gets its record or section), finds the Ray cluster (or starts one on this machine)
and fits the placement plan to its nodes first, so an unreachable address or a plan the
cluster cannot hold is refused before anything slow; then it prepares the policy (a
user's checkpoint, or the built-in model after its cached supervised warm-up), starts the
pools of Figure 6 one builder each (``staleflow.runtime.driver.pools``), and only watches:
it copies per-step metric records from the control plane into the run folder and the
terminal until the trainer has taken its last step.

Run folder: ``config.yaml`` (resolved), ``metrics.jsonl`` (one record per step),
``summary.json``, ``checkpoint/`` (the final policy), ``checkpoints/`` (the run's state,
every ``checkpoint_every`` steps and when it stops or ends: ``--resume`` continues from
it, docs/recovery.md), ``live.json`` while it runs.

A run asked to stop (``stop`` set; the CLI sets it on Ctrl-C and SIGTERM) interrupts its
rollouts so that every partial response is whole in the TS, finishes the training step
in progress, writes the checkpoint and ends; a resumed run (``resume=``) starts every
actor from the checkpoint and goes on to its step count.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.config import ModelConfig, RunConfig, config_to_dict
from staleflow.config.env import ENV_TASKS
from staleflow.data import ArithmeticConfig, PromptDataset, load_dataset, synthetic_dataset
from staleflow.data.datasets import PromptFormat, chat_template_of, check_chat_template
from staleflow.data.hf_datasets import load_hf_dataset
from staleflow.data.layouts import DatasetError
from staleflow.data.tokenizer import TokenizerError
from staleflow.models.errors import ModelError
from staleflow.models.lora import with_adapters
from staleflow.progress import SILENT, Progress
from staleflow.runfolder.layout import RunLayout
from staleflow.runfolder.run_state import CRASHED, FINISHED, STOPPED, StateWriter
from staleflow.runfolder.run_summary import RunSummary
from staleflow.runfolder.step_record import (
    CORRECTED,
    StepRecord,
    evaluations,
    filtered_share,
    reward_mean,
    speculation_counts,
    speculation_keys,
    trainer_idle_ratio,
)
from staleflow.runfolder.writer import RunOutput
from staleflow.runtime.backends import check_backends
from staleflow.runtime.driver.env_task import env_dataset
from staleflow.runtime.driver.evaluation import held_out_reward, heldout_set
from staleflow.runtime.driver.launch_checks import check_launch
from staleflow.runtime.driver.launch_progress import TrainingWaits, actors_phase
from staleflow.runtime.driver.resume import restore_state
from staleflow.runtime.driver.run import Run, cause
from staleflow.runtime.driver.run_plan import RunPlan, TaskPlan, plan_run
from staleflow.runtime.driver.stopping import graceful_stop
from staleflow.runtime.driver.supervisor import Supervisor
from staleflow.runtime.errors import LaunchError, PlacementError
from staleflow.runtime.placement.fitting import Placement
from staleflow.runtime.placement.placing import Phase, log_phase, place
from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE, RayCluster
from staleflow.tracking import Trackers, open_trackers, parse_trackers

if TYPE_CHECKING:
    from staleflow.data import PromptDataset
    from staleflow.data.tokenizer import Tokenizer
    from staleflow.recovery import Checkpoint
    from staleflow.runtime.driver.resume import ResumePoint

logger = logging.getLogger(__name__)

# called with the started Run; what it returns is called before the actors go away
OnStarted = Callable[[Run], Callable[[], None] | None]

__all__ = [
    "ACTOR_NAMESPACE",
    "LaunchError",
    "PlacementError",
    "Run",
    "RunResult",
    "build_dataset",
    "check_backends",
    "launch",
    "place",
    "prepare_policy",
    "reward_mean",
    "summarise",
]


@dataclass
class RunResult:
    run_dir: Path
    records: list[StepRecord]
    summary: RunSummary  # what summary.json holds
    consumed: list[dict[str, Any]] = field(default_factory=list)  # per step: ids, versions
    stopped: bool = False  # asked to stop before its step count: resume it
    checkpoint: Path | None = None  # the last run checkpoint written


# -- before anything slow ------------------------------------------------------------------


def prepare_policy(
    m: ModelConfig, task: TaskPlan, phase: Phase = log_phase, progress: Progress = SILENT
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, facts) for the run: a local checkpoint (the ``model`` section
    ``m``), or the built-in policy of ``task``, warmed (its warm-up reports a ``warmup``
    phase to ``progress``)."""
    # torch: loaded once the run builds its policy; `launch --check` and a refused
    # --resume never pay for it
    from staleflow.models.checkpoint import load_pretrained

    data, seed = task.data, task.seed
    if m.checkpoint:
        tokenizer_note = f" with the tokenizer {data.tokenizer}" if data.tokenizer else ""
        phase(f"loading the policy from {m.checkpoint}{tokenizer_note}")
        model, tokenizer = load_pretrained(m.checkpoint, tokenizer_path=data.tokenizer or None)
        return model, tokenizer, {"source": str(m.checkpoint)}
    if data.task not in ("arithmetic", "calculator"):
        raise LaunchError(
            f"data.task={data.task!r} needs model.checkpoint (a local Hugging Face "
            "checkpoint directory): the built-in model only knows the built-in tasks"
        )
    # torch, as above: the built-in policies and their warm-ups
    from staleflow.models.tool_warmup import (
        build_calculator_model,
        ensure_warm_calculator_checkpoint,
    )
    from staleflow.models.warmup import (  # torch, as above
        build_arithmetic_model,
        ensure_warm_checkpoint,
        read_warmup_meta,
    )

    problems = ArithmeticConfig.level(data.difficulty)
    calculator = data.task == "calculator"  # the multi-turn task: a tokenizer with tool markup
    if calculator:
        build, ensure = build_calculator_model, ensure_warm_calculator_checkpoint
        untrained = not m.warmup or not m.warmup_steps
        building = f"building the built-in {m.preset} model for the calculator task, untrained"
        preparing = f"preparing the built-in {m.preset} model for the calculator task"
    else:
        build, ensure = build_arithmetic_model, ensure_warm_checkpoint
        untrained = not m.warmup
        building = f"building the built-in {m.preset} model, untrained (model.warmup=false)"
        preparing = (
            f"preparing the built-in {m.preset} model (the first run warms it up on the task; "
            "later runs reuse it)"
        )
    if untrained:
        phase(building)
        model, tokenizer = build(m.preset, seed=seed)
        return model, tokenizer, {"source": f"{m.preset} (untrained)"}
    phase(preparing)
    path = ensure(
        m.preset,
        problems,
        steps=m.warmup_steps,
        seed=seed,
        target_accuracy=m.warmup_target or None,
        cache_dir=m.cache_dir or None,
        progress=progress,
    )
    model, tokenizer = load_pretrained(path)
    meta = read_warmup_meta(path)
    return (
        model,
        tokenizer,
        {
            "source": str(path),
            "warmup_accuracy": meta.get("accuracy_t1"),
            "warmup_steps": meta.get("stats", {}).get("steps"),
        },
    )


def build_dataset(task: TaskPlan, tokenizer: Tokenizer) -> PromptDataset:
    """The prompts of the run, without those longer than ``data.max_prompt_tokens``.
    Raises :class:`DatasetError` or :class:`TokenizerError` (data.chat_template=true with a
    tokenizer that has no template)."""

    data = task.data
    fmt = PromptFormat(data.chat_template, data.system_prompt)
    check_chat_template(tokenizer, fmt, data.tokenizer or task.checkpoint)
    layout = data.record_layout()
    if data.task in ENV_TASKS:
        dataset = env_dataset(task, tokenizer)
    elif data.task == "arithmetic":
        # A seed apart from the warm-up's own problem stream (see models.warmup).
        problems = ArithmeticConfig.level(data.difficulty, seed=task.seed + 1)
        dataset = synthetic_dataset(tokenizer, problems, size=100_000)
    elif data.task == "hf":
        dataset = load_hf_dataset(data.path, tokenizer, layout, fmt, data.split)
    else:
        dataset = load_dataset(data.path, tokenizer, layout, fmt)
    limit = data.max_prompt_tokens
    keep = [s for s in dataset if len(s.prompt_ids) <= limit]
    if len(keep) == len(dataset):
        return dataset
    if not keep:
        raise LaunchError(
            f"every prompt of {dataset.name} is longer than data.max_prompt_tokens={limit}; "
            "raise data.max_prompt_tokens"
        )
    logger.warning(
        "%s: skipping %d of %d prompts longer than data.max_prompt_tokens=%d",
        dataset.name,
        len(dataset) - len(keep),
        len(dataset),
        limit,
    )
    return PromptDataset(dataset.name, [s.prompt_ids for s in keep], [s.answer for s in keep])


# -- after the run ---------------------------------------------------------------------------


def summarise(records: list[StepRecord], facts: dict[str, Any]) -> RunSummary:
    """What the final table and ``summary.json`` show, from every step's record: a
    resumed run's ``records`` are the whole run's (the checkpoint's, then this launch's),
    so the summary agrees with the whole ``metrics.jsonl``. Records written before the
    per-step token histogram (``staleness/token_hist/<k>``) lack it: then
    ``token_staleness_steps`` says how many steps the token histogram covers."""
    if not records:
        return RunSummary.from_json({"steps": 0, **facts})
    last = records[-1]
    k = max(1, len(records) // 4)
    staleness: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    token_steps = 0
    for rec in records:
        staleness.update(rec.staleness)
        if rec.token_staleness:
            tokens.update(rec.token_staleness)
            token_steps += 1
    partial = {"token_staleness_steps": token_steps} if token_steps < len(records) else {}
    sampled = filtered_share(records)  # dynamic sampling's drops (None: off)
    if sampled is not None:
        partial |= {"filtered_groups": sampled[0], "filtered_frac": sampled[1]}
    if (counts := speculation_counts(last.extra)) is not None:  # cumulative: the last's
        partial |= {k.replace("/", "_"): v for k, v in speculation_keys(*counts).items()}
    # the facts gathered along the launch become the record's typed fields (any it does
    # not name are kept in its ``extra``)
    return RunSummary.from_json(
        {
            "steps": len(records),
            "elapsed_s": last.elapsed_s,
            "tokens_per_s": last.tokens_per_s,
            "reward_start": reward_mean(records[:k]),
            "reward_end": reward_mean(records[-k:]),
            "staleness_hist": dict(sorted(staleness.items())),
            "staleness_max": max((s for s, n in staleness.items() if n), default=0),
            "staleness_mean": _mean_of(staleness),
            "corrected_frac": corrected_frac(records),
            "token_staleness_hist": dict(sorted(tokens.items())),
            "on_policy_tokens": set(tokens) <= {0},
            "trainer_idle_ratio": trainer_idle_ratio(records),
            "rollout_idle_ratio": last.rollout_idle_ratio,
            "time_share": last.time_shares(),
            **evaluations(records),
            **partial,
            **facts,
        }
    )


def _mean_of(hist: dict[int, int]) -> float | None:
    total = sum(hist.values())
    return sum(k * n for k, n in hist.items()) / total if total else None


def corrected_frac(records: list[StepRecord]) -> float | None:
    """The share of all trained tokens the off-policy correction clipped or masked
    (``train/corrected_frac`` of each step, weighted by its tokens); None if no step
    reported it."""
    done = [
        (r.extra[CORRECTED], r.tokens or 0)
        for r in records
        if CORRECTED in r.extra and math.isfinite(r.extra[CORRECTED])
    ]
    tokens = sum(n for _, n in done)
    if not done:
        return None
    if not tokens:
        return sum(f for f, _ in done) / len(done)
    return sum(f * n for f, n in done) / tokens


# -- the launch ------------------------------------------------------------------------------


def launch(
    cfg: RunConfig,
    *,
    on_record: Callable[[StepRecord], None] | None = None,
    on_tick: Callable[[Any], None] | None = None,
    on_phase: Phase | None = None,
    resume: Checkpoint | None = None,
    stop: threading.Event | None = None,
    handle_signals: bool = False,
    on_started: OnStarted | None = None,
    progress: Progress = SILENT,
) -> RunResult:
    """Run ``cfg`` to the end; see the module docstring. Every message about what the
    launch is doing goes through ``on_phase`` (one callback); the long waits (warm-up,
    scoring, actor start-up, first buffer, training) report their steps, metrics and time
    left to ``progress`` (``staleflow.progress``: bars in a terminal, lines in a log).

    ``resume``: a checkpoint :func:`staleflow.runtime.driver.resume.check_resume` verified, with
    the configuration it returned. ``stop``: set it to stop the run gracefully;
    ``handle_signals`` sets it on SIGINT and SIGTERM (a second one stops at once).
    ``on_started`` is called once the actors are up (``staleflow launch`` serves the
    dashboard there when ``cfg.dashboard``:
    :class:`staleflow.dashboard.launch_hook.LaunchDashboard`); what it returns is called
    before the actors go away."""
    phase = on_phase or log_phase
    plan = plan_run(cfg)  # resolved once: every part below gets its record or section
    check_launch(plan)
    cluster, placement = place(plan.placement, phase)
    stop = stop or threading.Event()
    try:
        # after Ray joined: ray.init installs a SIGTERM handler of its own
        with graceful_stop(stop, phase) if handle_signals else contextlib.nullcontext():
            return _launch_on(
                cluster,
                placement,
                plan,
                phase,
                on_record,
                on_tick,
                on_started,
                progress,
                resume,
                stop,
            )
    finally:
        cluster.shutdown()


def _prepare(
    plan: RunPlan, phase: Phase, resume: Checkpoint | None, progress: Progress
) -> tuple[Any, Any, PromptDataset, PromptDataset | None, dict[str, Any], ResumePoint | None]:
    """The policy, tokenizer, prompts and held-out set (None: no evaluation during
    training); a resumed run's from its checkpoint."""

    started = time.monotonic()
    try:
        if resume is None:
            model, tokenizer, facts = prepare_policy(plan.model, plan.task, phase, progress)
        else:
            # torch, as above: the resumed policy
            from staleflow.models.checkpoint import load_pretrained

            phase(f"resuming from {resume.path} (step {resume.steps}, version {resume.version})")
            model, tokenizer = load_pretrained(resume.trainer_dir)
            facts = {"source": str(resume.trainer_dir), "resumed_from": str(resume.path)}
        if plan.trainer.lora.enabled:  # the base frozen, an adapter trained (and resumed)
            with_adapters(
                model,
                plan.trainer.lora,
                seed=plan.seed,
                checkpoint=None if resume is None else resume.trainer_dir,
            )
    except ModelError as exc:  # a checkpoint that cannot be loaded: say so, no traceback
        raise LaunchError(f"cannot load the policy: {exc}") from exc
    try:
        dataset = build_dataset(plan.task, tokenizer)
    except (DatasetError, TokenizerError) as exc:
        raise LaunchError(f"cannot read the prompts: {exc}") from exc
    try:
        heldout = heldout_set(plan.task, tokenizer)
    except (DatasetError, TokenizerError) as exc:
        raise LaunchError(f"cannot read the held-out set (eval.path): {exc}") from exc
    if plan.task.data.chat_template:
        # the template the prompts went through, with the run (summary.json, the trackers)
        facts["chat_template"] = chat_template_of(tokenizer)
    point = None
    if resume is not None:
        point = restore_state(plan.trajectory_server, plan.control.sampling, resume, dataset)
    elif (
        start := held_out_reward(plan.task, plan.rollout, model, tokenizer, progress)
    ) is not None:
        facts["eval_problems"] = plan.task.eval.problems
        facts["eval_reward_start"] = start
    facts["prepare_s"] = time.monotonic() - started
    return model, tokenizer, dataset, heldout, facts, point


def _launch_on(
    cluster: RayCluster,
    placement: Placement,
    plan: RunPlan,
    phase: Phase,
    on_record: Callable[[StepRecord], None] | None,
    on_tick: Callable[[Any], None] | None,
    on_started: OnStarted | None,
    progress: Progress,
    resume: Checkpoint | None,
    stop: threading.Event,
) -> RunResult:
    model, tokenizer, dataset, heldout, facts, point = _prepare(plan, phase, resume, progress)
    if resume is None:
        out = RunOutput.create(plan.config)
    else:  # the steps after the checkpoint are done again
        out = RunOutput.resume(resume.path.parents[1], plan.config, resume.metrics, resume.version)
    phase(f"run folder {out.path}")
    state = StateWriter(out.path, resumed=resume is not None)
    state.phase("starting")
    run = Run(
        plan,
        out.path,
        supervisor=Supervisor,
        cluster=cluster,
        placement=placement,
        phase=phase,
        heldout=heldout,
    )
    records = [StepRecord.from_flat(r) for r in resume.metrics] if resume is not None else []
    waits = TrainingWaits(progress, plan.control.staleness, plan.steps, on_tick)
    trackers = Trackers()

    def record(rec: StepRecord) -> None:
        waits.record(rec)
        records.append(rec)
        out.record(rec)
        trackers.log_step(rec.step, rec.to_flat())
        if on_record is not None:
            on_record(rec)

    stop_watching: Callable[[], None] | None = None
    failed = True
    try:
        trackers = _start_trackers(plan, out.path, facts)
        try:
            ps_replicas = len(placement.pool("parameter_server"))
            workers = (plan.rollout.instances, plan.reward.workers, ps_replicas)
            with actors_phase(progress, *workers) as stages:
                run.start(model, tokenizer, dataset, stages, point)
        except LaunchError:
            raise
        except Exception as exc:  # an actor that failed to start: name it, no Ray traceback
            raise LaunchError(f"the actors could not start: {cause(exc)}") from exc
        facts["placement"] = run.placement_info
        if on_started is not None:
            stop_watching = on_started(run)
        todo = plan.steps - run.steps_before
        phase(f"training {todo} steps with eta={plan.eta}" + (" (resumed)" if resume else ""))
        state.phase("training")
        with waits:
            reports = run.train(
                todo, record, waits.on_tick(), stop=stop, on_done=lambda: state.phase("finishing")
            )
        stopped = len(reports) < todo
        if not stopped:
            run.save_checkpoint(out.path / "checkpoint")
        state.phase("auditing")
        facts["audit"] = run.audit()
        failed = False
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        state.end(STOPPED if interrupted else CRASHED, _ended(exc))
        trackers.close(failed=True)
        raise
    finally:
        if stop_watching is not None:
            stop_watching()  # before the actors it polls go away
        run.shutdown()
        out.close(failed=failed)  # a launch that never trained leaves no folder behind
    if "eval_reward_start" in facts and not stopped:
        # torch, as above: the final policy, for its held-out reward
        from staleflow.models.checkpoint import load_pretrained

        final, _ = load_pretrained(out.path / "checkpoint")
        facts["eval_reward_end"] = held_out_reward(
            plan.task, plan.rollout, final, tokenizer, progress, "final"
        )
    last = run.checkpoints[-1] if run.checkpoints else None
    facts["stopped"] = stopped
    if last is not None:
        facts["resume_from"] = str(last)
    facts["launch"] = state.launch  # status tells this launch's summary from an earlier one's
    summary = summarise(records, facts)
    RunLayout(out.path).write_summary(summary)
    trackers.log_summary(summary.to_json())
    trackers.close(failed=False)
    state.end(STOPPED if stopped else FINISHED, "a signal asked it to stop" if stopped else "")
    consumed = [
        {
            "version": r.version,
            "staleness": dict(r.staleness),
            "token_staleness": dict(r.token_staleness),
            "traj_ids": list(r.consumed_traj_ids),
        }
        for r in reports
    ]
    return RunResult(out.path, records, summary, consumed, stopped, last)


def _start_trackers(plan: RunPlan, run_dir: Path, facts: dict[str, Any]) -> Trackers:
    """The run's trackers (``tracking``), started in the run folder with the resolved
    configuration and the facts known before training (the policy's source, the chat
    template...)."""
    names = parse_trackers(plan.tracking)
    if not names:
        return Trackers()
    try:
        trackers = open_trackers(names, run_dir, run_dir.name, plan.tracking_project)
    except Exception as exc:  # a library that cannot start: before any actor, say which
        raise LaunchError(f"the trackers ({plan.tracking}) could not start: {exc}") from exc
    trackers.log_config({**config_to_dict(plan.config), "facts": dict(facts)})
    return trackers


def _ended(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "stopped at once by a second signal: resume from the previous checkpoint"
    return f"{type(exc).__name__}: {cause(exc)}"


def check_placement(cfg: RunConfig, phase: Phase = log_phase) -> Placement:
    """``staleflow launch --check``: what the run would ask and where it would go, without
    starting it."""
    plan = plan_run(cfg)
    check_launch(plan)
    cluster, placement = place(plan.placement, phase)
    cluster.shutdown()
    return placement
