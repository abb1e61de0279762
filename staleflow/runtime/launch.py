"""``staleflow launch``: one real, fully disaggregated, staleness-bounded RL run.

The driver prepares the policy (a user's checkpoint, or the built-in model after its
cached supervised warm-up), starts the actors of ``actors.py`` on a local or existing Ray
cluster, then only watches: it copies per-step metric records from the control plane
into the run folder and the terminal until the trainer has taken its last step.

Run folder: ``config.yaml`` (resolved), ``metrics.jsonl`` (one record per step),
``summary.json``, ``checkpoint/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from staleflow.install import missing
from staleflow.progress import SILENT, SILENT_PHASE, Phase, Progress
from staleflow.runtime.components import (
    ModelSpec,
    RewardSpec,
    RolloutSpec,
    TrainerSpec,
    model_spec,
)
from staleflow.runtime.evaluation import held_out_reward
from staleflow.runtime.phases import TrainingWaits, actors_phase
from staleflow.runtime.runfolder import reward_mean  # also imported from here

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "staleflow"  # staleflow.dashboard.ray_source finds runs here


class LaunchError(RuntimeError):
    """The run could not start or stopped early; the message says which part and why."""


@dataclass
class RunResult:
    run_dir: Path
    records: list[dict[str, float]]
    summary: dict[str, Any]
    consumed: list[dict[str, Any]] = field(default_factory=list)  # per step: ids, versions


# -- preparation (driver process) ---------------------------------------------------------


def check_backends(cfg: Any) -> None:
    """Refuse backends that ``launch`` cannot build yet, rather than quietly running the
    embedded ones in their place (the config accepts them for the cluster path)."""
    for key, value in (
        ("rollout.backend", cfg.rollout.backend),
        ("trainer.backend", cfg.trainer.backend),
    ):
        if value != "embedded":
            raise LaunchError(
                f"{key}={value} is not implemented in staleflow launch yet: only the embedded "
                f"CPU backends run; use {key}=embedded"
            )


def ray_init_kwargs(cfg: Any) -> dict[str, Any]:
    """``ray.init`` arguments: join ``cfg.address`` (``auto``, ``host:port``, ``ray://``)
    when set, else start a local Ray."""
    kwargs: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    if cfg.address:
        kwargs["address"] = cfg.address
    else:  # its own Ray even where `ray start` runs one (ray.init() would join that)
        kwargs["address"] = "local"
        kwargs["num_cpus"] = max(os.cpu_count() or 1, 4)  # CPU slots only gate scheduling
    return kwargs


def make_run_dir(cfg: Any) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = cfg.name or f"eta{cfg.eta}"
    base = Path(cfg.run_dir).expanduser()
    path = base / f"{stamp}-{name}"
    n = 1
    while path.exists():
        n += 1
        path = base / f"{stamp}-{name}-{n}"
    path.mkdir(parents=True)
    return path


def prepare_policy(cfg: Any, progress: Progress = SILENT) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, facts) for the run: a local checkpoint, or the warmed built-in."""
    from staleflow.models.checkpoint import load_pretrained

    if cfg.model.checkpoint:
        model, tokenizer = load_pretrained(
            cfg.model.checkpoint, tokenizer_path=cfg.data.tokenizer or None
        )
        return model, tokenizer, {"source": str(cfg.model.checkpoint)}
    if cfg.data.task != "arithmetic":
        raise LaunchError(
            f"data.task={cfg.data.task!r} needs model.checkpoint (a local Hugging Face "
            "checkpoint directory): the built-in model only knows the arithmetic task"
        )
    from staleflow.data.synthetic import ArithmeticConfig
    from staleflow.models.build import build_arithmetic_model
    from staleflow.models.warmup import ensure_warm_checkpoint, read_warmup_meta

    task = ArithmeticConfig.level(cfg.data.difficulty)
    if not cfg.model.warmup:
        model, tokenizer = build_arithmetic_model(cfg.model.preset, seed=cfg.seed)
        return model, tokenizer, {"source": f"{cfg.model.preset} (untrained)"}
    path = ensure_warm_checkpoint(
        cfg.model.preset,
        task,
        steps=cfg.model.warmup_steps,
        seed=cfg.seed,
        target_accuracy=cfg.model.warmup_target or None,
        cache_dir=cfg.model.cache_dir or None,
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


def build_dataset(cfg: Any, tokenizer: Any) -> Any:
    """The prompts of the run, without those longer than ``data.max_prompt_tokens``."""
    from staleflow.data import ArithmeticConfig, PromptDataset, load_dataset, synthetic_dataset

    if cfg.data.task == "arithmetic":
        # A seed apart from the warm-up's own problem stream (see models.warmup).
        task = ArithmeticConfig.level(cfg.data.difficulty, seed=cfg.seed + 1)
        dataset = synthetic_dataset(tokenizer, task, size=100_000)
    else:
        dataset = load_dataset(cfg.data.path, tokenizer)
    limit = cfg.data.max_prompt_tokens
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


# -- the run -------------------------------------------------------------------------------


class Run:
    """The actors of one run; :meth:`start`, :meth:`wait`, :meth:`shutdown`."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.actors: dict[str, Any] = {}
        self._ray: Any = None
        self._started_ray = False

    # -- start -----------------------------------------------------------------------

    def start(self, model: Any, tokenizer: Any, dataset: Any, stages: Phase = SILENT_PHASE) -> None:
        import ray

        from coordinator.config import CostModelConfig
        from parameter_server.torch_compat import state_dict_to_numpy
        from parameter_server.transport import connect
        from staleflow.data import PromptSampler
        from staleflow.models.state import policy_state
        from staleflow.rewards import resolve_reward_kind
        from staleflow.runtime import actors
        from staleflow.runtime.control import ControlConfig
        from staleflow.runtime.ray_address import check_reachable
        from staleness import StalenessConfig
        from trajectory_server import TrajectoryServerConfig
        from trajectory_server.actor import spawn_trajectory_server

        cfg = self.cfg  # launch() has refused backends it cannot build (check_backends)
        self._ray = ray
        if not ray.is_initialized():
            if cfg.address:
                try:
                    check_reachable(cfg.address)
                except (ConnectionError, ValueError) as exc:
                    raise LaunchError(str(exc)) from None
            ray.init(**ray_init_kwargs(cfg))
            self._started_ray = True
        stages.advance(detail="Ray up")
        spec = model_spec(model, tokenizer)
        remote = {
            name: ray.remote(cls)
            for name, cls in (
                ("ps", actors.ParameterServerActor),
                ("control", actors.ControlActor),
                ("reward", actors.RewardActor),
                ("rollout", actors.RolloutActor),
                ("trainer", actors.TrainerActor),
            )
        }
        multi_node = bool(cfg.address)
        tcp_host = ray.util.get_node_ip_address() if multi_node else ""
        ps = (
            remote["ps"]
            .options(num_cpus=0, **self._named("ps"))
            .remote(
                spec.layout,
                cfg.parameter_server.num_slots,
                cfg.parameter_server.transport == "nixl",
                tcp_host,
            )
        )
        self.actors["ps"] = ps
        endpoint = ray.get(ps.endpoint.remote())
        with connect(endpoint, cfg.parameter_server.transport) as client:
            client.push(state_dict_to_numpy(policy_state(model)), 0)
        stages.advance(detail="PS up")

        ts = spawn_trajectory_server(
            TrajectoryServerConfig(
                eta=cfg.eta,
                batch_size=cfg.batch_size,
                group_size=cfg.group_size,
                group_redundancy=cfg.group_redundancy,
                batch_redundancy=cfg.batch_redundancy,
            ),
            PromptSampler(dataset, seed=cfg.seed),
            **self._named("ts"),
        )
        self.actors["ts"] = ts.handle
        stages.advance(detail="TS up")
        coordinator = cfg.coordinator
        if coordinator.cost_model.kv_budget is None:
            # The strategies must plan with the engines' real KV budget.
            from dataclasses import replace

            coordinator = replace(
                coordinator,
                cost_model=replace(
                    coordinator.cost_model, kv_budget=float(cfg.rollout.kv_budget_tokens)
                )
                if isinstance(coordinator.cost_model, CostModelConfig)
                else coordinator.cost_model,
            )
        control_cfg = ControlConfig(
            StalenessConfig(
                eta=cfg.eta,
                batch_size=cfg.batch_size,
                group_size=cfg.group_size,
                batch_redundancy=cfg.batch_redundancy,
                group_redundancy=cfg.group_redundancy,
            ),
            coordinator,
        )
        transport = cfg.parameter_server.transport
        control = (
            remote["control"]
            .options(num_cpus=0, max_concurrency=16, **self._named("control"))
            .remote(control_cfg, ts.handle, endpoint, transport)
        )
        self.actors["control"] = control
        reward_spec = RewardSpec(
            kind=resolve_reward_kind(cfg.reward.kind, cfg.data.task),
            timeout_s=cfg.reward.timeout_s,
            tokenizer=spec.tokenizer,
        )
        rewards = [
            remote["reward"]
            .options(num_cpus=0, **self._named(f"reward/{w}"))
            .remote(reward_spec, ts.handle, control)
            for w in range(cfg.reward.workers)
        ]
        self.actors["rewards"] = rewards
        rollout_spec = self._rollout_spec(spec, dataset)
        instances = {
            i: remote["rollout"]
            .options(num_cpus=0, **self._named(f"instance/{i}"))
            .remote(i, rollout_spec, endpoint, ts.handle, rewards)
            for i in range(cfg.rollout.instances)
        }
        self.actors["instances"] = instances
        ray.get([h.times.remote() for h in instances.values()])  # built and serving
        ray.get(control.attach.remote(instances))
        stages.advance(detail="control, reward, rollout up")
        trainer = (
            remote["trainer"]
            .options(num_cpus=0, **self._named("trainer"))
            .remote(
                TrainerSpec(
                    model=spec,
                    transport=transport,
                    options=self._trainer_options(),
                    num_threads=cfg.trainer.num_threads,
                    consume_timeout_s=cfg.trainer.stall_timeout_s or None,
                    checkpoint_dir=str(self.run_dir / "checkpoints"),
                    checkpoint_every=cfg.checkpoint_every,
                ),
                endpoint,
                ts.handle,
                control,
            )
        )
        self.actors["trainer"] = trainer
        stages.advance(detail="trainer up")

    def _named(self, role: str) -> dict[str, str]:
        """Ray actor name ``<run folder name>/<role>`` in the namespace ``staleflow``, so
        that ``staleflow dashboard --address`` and ``staleflow status`` can find the run."""
        return {"name": f"{self.run_dir.name}/{role}", "namespace": ACTOR_NAMESPACE}

    def _rollout_spec(self, spec: ModelSpec, dataset: Any) -> RolloutSpec:
        r = self.cfg.rollout
        longest_prompt = int(dataset.prompt_lengths.max())
        return RolloutSpec(
            model=spec,
            transport=self.cfg.parameter_server.transport,
            max_response=r.max_response_tokens,
            max_seq_len=longest_prompt + r.max_response_tokens,
            kv_budget_tokens=max(r.kv_budget_tokens, longest_prompt + r.max_response_tokens),
            max_running=r.max_running,
            temperature=r.temperature,
            top_p=r.top_p,
            num_threads=r.num_threads,
            seed=self.cfg.seed,
        )

    def _trainer_options(self) -> dict[str, Any]:
        t = self.cfg.trainer
        return {
            "lr": t.lr,
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            "eps_low": t.eps_low,
            "eps_high": t.eps_high,
            "off_policy": t.off_policy,
            "is_cap": t.is_cap,
            "is_cap_mode": t.is_cap_mode,
            "advantage": t.advantage,
            "micro_batch_size": t.micro_batch_size,
            "updates_per_step": t.updates_per_step,
            "seed": self.cfg.seed,
        }

    # -- watch -----------------------------------------------------------------------

    def train(
        self,
        steps: int,
        on_record: Callable[[dict[str, float]], None],
        on_tick: Callable[[Any], None] | None = None,
        poll_s: float = 0.5,
    ) -> list[Any]:
        """Run ``steps`` training steps; stream records; return the trainer's reports."""
        ray = self._ray
        control = self.actors["control"]
        done_ref = self.actors["trainer"].run.remote(steps)
        seen = 0
        while True:
            ready, _ = ray.wait([done_ref], timeout=poll_s)
            try:
                new = ray.get(control.records.remote(seen))
                live = ray.get(control.live.remote()) if on_tick is not None else None
            except Exception as exc:  # named for the user below
                raise LaunchError(f"the control plane stopped: {_cause(exc)}") from exc
            for rec in new:
                on_record(rec)
            seen += len(new)
            if on_tick is not None:
                on_tick(live)
            if ready:
                break
        try:
            reports = ray.get(done_ref)
        except Exception as exc:
            raise LaunchError(f"the trainer stopped: {_cause(exc)}") from exc
        ray.get(control.stop.remote())  # flushes the last step's record
        for rec in ray.get(control.records.remote(seen)):
            on_record(rec)
        return reports

    def audit(self) -> dict[str, int]:
        """After training: stop routing, call every trajectory back to the TS and wait for
        the reward path, then count. Every trajectory ever created must be consumed,
        aborted, queued or completed in the TS, none left routed or on an instance."""
        ray = self._ray
        ray.get(self.actors["control"].stop.remote())
        instances = self.actors["instances"]
        for h in instances.values():
            held = ray.get(h.held.remote())
            ray.get(h.interrupt.remote(sorted(held)))
        ray.get([h.drain.remote() for h in instances.values()])
        left = sum(len(ray.get(h.held.remote())) for h in instances.values())
        stats = ray.get(self.actors["ts"].stats.remote())
        return {
            "created": stats.created_trajectories,
            "consumed": stats.consumed_trajectories,
            "aborted": stats.aborted_trajectories,
            "queued": stats.queued,
            "routed": stats.routed,
            "completed": stats.completed,
            "on_instances": left,
        }

    def save_checkpoint(self, path: Path) -> None:
        self._ray.get(self.actors["trainer"].save_checkpoint.remote(str(path)))

    def shutdown(self) -> None:
        ray = self._ray
        if ray is None:
            return
        if "control" in self.actors:
            with contextlib.suppress(Exception):  # best effort while tearing down
                ray.get(self.actors["control"].stop.remote(), timeout=10)
        for h in self.actors.get("instances", {}).values():
            with contextlib.suppress(Exception):
                ray.get(h.stop.remote(), timeout=10)
        if "ps" in self.actors:
            with contextlib.suppress(Exception):
                ray.get(self.actors["ps"].stop.remote(), timeout=10)
        for value in self.actors.values():
            if isinstance(value, dict):
                handles = list(value.values())
            elif isinstance(value, list):
                handles = value
            else:
                handles = [value]
            for h in handles:
                with contextlib.suppress(Exception):
                    ray.kill(h)
        self.actors.clear()
        if self._started_ray:
            ray.shutdown()


def _cause(exc: BaseException) -> str:
    """The innermost message of a Ray error chain, which names what really failed."""
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-3:]
    return " / ".join(tail) if tail else repr(exc)


def summarise(
    records: list[dict[str, float]], reports: list[Any], facts: dict[str, Any]
) -> dict[str, Any]:
    """What the final table and ``summary.json`` show."""
    if not records:
        return {"steps": 0, **facts}
    last = records[-1]
    k = max(1, len(records) // 4)
    staleness: dict[int, int] = {}
    tokens: dict[int, int] = {}
    for rep in reports:
        for s, n in rep.staleness.items():
            staleness[int(s)] = staleness.get(int(s), 0) + int(n)
        for s, n in rep.token_staleness.items():
            tokens[int(s)] = tokens.get(int(s), 0) + int(n)
    out: dict[str, Any] = {
        "steps": len(records),
        "elapsed_s": last["time/elapsed_s"],
        "tokens_per_s": last["throughput/tokens_per_s"],
        "reward_start": reward_mean(records[:k]),
        "reward_end": reward_mean(records[-k:]),
        "staleness_hist": dict(sorted(staleness.items())),
        "staleness_max": max(staleness) if staleness else 0,
        "token_staleness_hist": dict(sorted(tokens.items())),
        "on_policy_tokens": set(tokens) <= {0},
        "trainer_idle_ratio": sum(r["trainer/wait_s"] for r in records) / last["time/elapsed_s"],
        "rollout_idle_ratio": last.get("rollout/idle_ratio"),
        "time_share": {
            k.removeprefix("rollout/time_share/"): v
            for k, v in last.items()
            if k.startswith("rollout/time_share/")
        },
        **facts,
    }
    return out


def _start_dashboard(cfg: Any, run: Run, phase: Callable[[str], None]) -> Any:
    """With ``dashboard=true``: serve the dashboard from this driver (a uvicorn thread);
    a dashboard that cannot start is reported and the run goes on without it."""
    if not cfg.dashboard:
        return None
    try:
        from staleflow.dashboard.launch_hook import start_dashboard
    except ImportError as exc:
        phase(f"dashboard off: {missing('the dashboard (fastapi, uvicorn)', exc)}")
        return None
    try:
        server = start_dashboard(cfg, run)
    except OSError as exc:
        phase(f"dashboard off: {exc}")
        return None
    phase(f"dashboard at {server.url}")
    return server


def launch(
    cfg: Any,
    *,
    on_record: Callable[[dict[str, float]], None] | None = None,
    on_tick: Callable[[Any], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    progress: Progress = SILENT,
) -> RunResult:
    """Run ``cfg`` to the end; see the module docstring."""
    from staleflow.config import save_config
    from staleflow.data.layouts import DatasetError
    from staleflow.models.errors import ModelError

    check_backends(cfg)
    phase = on_phase or (lambda text: logger.info("%s", text))
    run_dir = make_run_dir(cfg)
    save_config(cfg.resolved(), run_dir / "config.yaml")  # auto choices made explicit
    phase(f"run folder {run_dir}")
    started = time.monotonic()
    phase("preparing the policy (the first run warms the built-in model up; later runs reuse it)")
    try:
        model, tokenizer, facts = prepare_policy(cfg, progress)
    except ModelError as exc:  # a checkpoint that cannot be loaded: say so, no traceback
        raise LaunchError(f"cannot load the policy: {exc}") from exc
    try:
        dataset = build_dataset(cfg, tokenizer)
    except DatasetError as exc:
        raise LaunchError(f"cannot read the prompts: {exc}") from exc
    if cfg.eval_problems and cfg.data.task == "arithmetic":
        facts["eval_problems"] = cfg.eval_problems
        facts["eval_reward_start"] = held_out_reward(cfg, model, tokenizer, progress)
    facts["prepare_s"] = time.monotonic() - started
    run = Run(cfg, run_dir)
    dashboard: Any = None
    records: list[dict[str, float]] = []
    metrics_file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
    waits = TrainingWaits(progress, cfg, on_tick)

    def record(rec: dict[str, float]) -> None:
        waits.record(rec)
        records.append(rec)
        metrics_file.write(json.dumps(rec, sort_keys=True) + "\n")
        metrics_file.flush()
        if on_record is not None:
            on_record(rec)

    try:
        try:
            with actors_phase(progress, cfg.rollout.instances, cfg.reward.workers) as stages:
                run.start(model, tokenizer, dataset, stages)
        except LaunchError:
            raise
        except Exception as exc:  # an actor that failed to start: name it, no Ray traceback
            raise LaunchError(f"the actors could not start: {_cause(exc)}") from exc
        dashboard = _start_dashboard(cfg, run, phase)
        with waits:
            reports = run.train(cfg.steps, record, waits.on_tick())
        run.save_checkpoint(run_dir / "checkpoint")
        facts["audit"] = run.audit()
    finally:
        metrics_file.close()
        if dashboard is not None:
            dashboard.stop()  # before the actors it polls go away
        run.shutdown()
    if "eval_reward_start" in facts:
        from staleflow.models.checkpoint import load_pretrained

        final, _ = load_pretrained(run_dir / "checkpoint")
        facts["eval_reward_end"] = held_out_reward(cfg, final, tokenizer, progress, "final")
    summary = summarise(records, reports, facts)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    consumed = [
        {
            "version": r.version,
            "staleness": dict(r.staleness),
            "token_staleness": dict(r.token_staleness),
            "traj_ids": list(r.consumed_traj_ids),
        }
        for r in reports
    ]
    return RunResult(run_dir, records, summary, consumed)
