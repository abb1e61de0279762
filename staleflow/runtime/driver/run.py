"""The actors of one run, started pool by pool in the order of Figure 6: the control
plane (staleness manager and coordinator) with the trajectory server, the parameter
server, the reward workers, the rollout instances, the trainer. Each pool's builder
gets its own typed section; :meth:`Run.train` then watches: it streams the step records,
writes the checkpoint cuts the control plane takes, and lets the supervisor
(``staleflow.runtime.driver.supervisor``) restart what died. A resumed run starts every pool
from its checkpoint (``staleflow.runtime.driver.resume``)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from parameter_server import Layout
from staleflow.data import PromptSampler
from staleflow.progress import SILENT_PHASE, Phase
from staleflow.recovery import RunState, list_checkpoints, write_checkpoint
from staleflow.runtime.controller.plane_records import Cut
from staleflow.runtime.driver.eval_rounds import EvalRounds
from staleflow.runtime.driver.pool_specs import rollout_spec, trainer_spec
from staleflow.runtime.driver.pools import PoolContext
from staleflow.runtime.driver.pools.controller import ControlPool, build_control
from staleflow.runtime.driver.pools.parameter_server import (
    PSPool,
    build_parameter_server,
    describe_weights,
)
from staleflow.runtime.driver.pools.rewards import RewardPool, build_rewards
from staleflow.runtime.driver.pools.rollout import RolloutPool, build_rollout, new_slot
from staleflow.runtime.driver.pools.trainer import TrainerPool, build_trainer
from staleflow.runtime.driver.supervised import Supervised
from staleflow.runtime.driver.supervised_ray import supervised_pools
from staleflow.runtime.errors import LaunchError
from staleflow.runtime.placement.placing import place
from staleflow.runtime.placement.plan import Bundle
from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE
from staleflow.runtime.workers.actors import InstanceRecovery, gone
from staleflow.runtime.workers.ps_healing import ReplicaResolver
from staleflow.runtime.workers.specs import RewardSpec, initial_weights, model_spec

if TYPE_CHECKING:
    from torch import nn

    from staleflow.config import RecoveryConfig
    from staleflow.data import PromptDataset
    from staleflow.data.tokenizer import Tokenizer
    from staleflow.runfolder.step_record import StepRecord
    from staleflow.runtime.driver.resume import ResumePoint
    from staleflow.runtime.driver.run_plan import RunPlan
    from staleflow.runtime.placement.fitting import Placement
    from staleflow.runtime.placement.ray_cluster import RayCluster, Reservation

logger = logging.getLogger(__name__)


class RunSupervisor(Protocol):
    """What the run asks of its supervisor (``staleflow.runtime.driver.supervisor``): it
    is handed in, so that the run does not import the supervisor that reads it."""

    def tick(self) -> None: ...
    def heal_ps(self, timeout_s: float = ...) -> None: ...
    def redispatch_rewards(self) -> int: ...
    def finish(self, timeout_s: float = ...) -> None: ...
    def close(self) -> None: ...


# builds the supervisor of a started run over its pools' faces (``Supervisor``, given by
# ``launch``)
SupervisorFactory = Callable[[Supervised, "RecoveryConfig"], RunSupervisor]


def cause(exc: BaseException) -> str:
    """The innermost message of a Ray error chain, which names what really failed."""
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-3:]
    return " / ".join(tail) if tail else repr(exc)


# -- the run -----------------------------------------------------------------------------------


class Run:
    """The actors of one run, built from its plan (``staleflow.runtime.driver.run_plan``);
    :meth:`start`, :meth:`train`, :meth:`shutdown`.

    Given no ``cluster``, :meth:`start` joins or starts one and fits the placement itself
    (and :meth:`shutdown` leaves it as it found it).
    """

    def __init__(
        self,
        plan: RunPlan,
        run_dir: Path,
        *,
        supervisor: SupervisorFactory,
        cluster: RayCluster | None = None,
        placement: Placement | None = None,
        phase: Callable[[str], None] | None = None,
        heldout: PromptDataset | None = None,
    ) -> None:
        self.plan = plan
        self.heldout = heldout  # the held-out set of eval.every (None: no evaluation)
        self.run_dir = run_dir
        self.cluster = cluster
        self.placement = placement
        self._own_cluster = cluster is None
        self._phase = phase or (lambda text: logger.info("%s", text))
        self.reservation: Reservation | None = None
        self.ctx: PoolContext | None = None
        self.control: ControlPool | None = None
        self.ps: PSPool | None = None
        self.reward_pool: RewardPool | None = None
        self.rollout: RolloutPool | None = None
        self.trainer: TrainerPool | None = None
        self.evals: EvalRounds | None = None
        self.placement_info: dict[str, Any] = {}
        self._supervise = supervisor
        self.supervisor: RunSupervisor | None = None
        self.steps_before = 0  # steps done before this launch (a resumed run's)
        self.checkpoints: list[Path] = []  # written by this launch
        self.tag = uuid.uuid4().hex[:6]  # tells this launch's holder ids from earlier ones

    @property
    def rewards(self) -> list[Any]:
        return list(self.reward_pool.workers.values()) if self.reward_pool else []

    @property
    def instances(self) -> dict[int, Any]:
        return dict(self.rollout.actors) if self.rollout else {}

    @property
    def actors(self) -> dict[str, Any]:
        """Every actor by role; ``ps`` is the first replica (dashboard and status)."""
        out: dict[str, Any] = {}
        if self.control is not None:
            out["control"] = self.control.control
            out["ts"] = self.control.ts.handle
        if self.ps is not None:
            out["ps"] = self.ps.first
            out["ps_replicas"] = dict(self.ps.actors)
        if self.rewards:
            out["rewards"] = list(self.rewards)
        if self.instances:
            out["instances"] = dict(self.instances)
        if self.trainer is not None:
            out["trainer"] = self.trainer.handles()
        return out

    # -- start -------------------------------------------------------------------------

    def start(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        dataset: PromptDataset,
        stages: Phase = SILENT_PHASE,
        resume: ResumePoint | None = None,
    ) -> None:
        """Build the pools; ``stages`` (the launch's ``actors`` phase) advances once per
        pool (``staleflow.runtime.driver.launch_progress.ACTOR_STAGES``). With ``resume``, from that
        checkpoint: the TS and the manager as restored, the PS and the trainer at its
        version (the trainer's weights, optimizer and RNG), the instances Pulling that
        version first."""
        plan = self.plan
        if self.cluster is None or self.placement is None:
            self.cluster, self.placement = place(plan.placement, self._phase)
        cluster, placement = self.cluster, self.placement
        self.reservation = cluster.reserve(
            placement, self.run_dir.name, plan.resources.placement_timeout_s
        )
        ctx = self.ctx = PoolContext(
            ray=cluster.ray,
            run=self.run_dir.name,
            placement=placement,
            reservation=self.reservation,
            driver_node=cluster.driver_node(),
            multi_node=bool(plan.address) or len(placement.nodes) > 1,
            phase=self._phase,
        )
        rec = plan.recovery
        recovery = InstanceRecovery(
            ReplicaResolver(ctx.run, ACTOR_NAMESPACE), rec.progress_every_s, rec.ps_patience_s
        )
        version = resume.version if resume is not None else 0
        self.steps_before = resume.steps if resume is not None else 0
        lora = plan.trainer.lora if plan.trainer.lora.enabled else None
        spec = model_spec(model, tokenizer, lora)
        self.control = build_control(
            ctx,
            plan.control,
            plan.trajectory_server,
            resume.sampler if resume is not None else PromptSampler(dataset, seed=plan.seed),
            ts_state=resume.trajectories if resume is not None else None,
            resolver=recovery.resolver,
            snapshot_timeout_s=rec.snapshot_timeout_s,
        )
        stages.advance(detail="control plane and TS up")
        # a resumed run's weights are the trainer checkpoint's, as its own version
        weights, base = initial_weights(model, spec)
        self.ps = build_parameter_server(
            ctx, plan.parameter_server, Layout.from_dict(spec.layout), weights, version, base
        )
        stages.advance(detail="PS up")
        self.reward_pool = build_rewards(
            ctx, RewardSpec(plan.reward, spec.tokenizer, plan.environment()), self.control, self.tag
        )
        stages.advance(detail="reward workers up")
        self.rollout = build_rollout(
            ctx,
            rollout_spec(
                plan,
                spec,
                dataset,
                run_dir=self.run_dir,
                policy=model,
                tokenizer=tokenizer,
                heldout=self.heldout,
            ),
            self.ps,
            self.control,
            self.reward_pool.live(),
            recovery,
            at_least=version,
            tag=self.tag,
        )
        ray = cluster.ray
        actors = self.rollout.actors
        self.control.driver.attach(
            {i: (h, self.rollout.holders[i]) for i, h in actors.items()},
            dict(self.ps.endpoints),
            dict(zip(actors, ray.get([h.version.remote() for h in actors.values()]), strict=True)),
            dict(resume.staleness) if resume is not None else None,
            list(resume.metrics) if resume is not None else [],
        )
        stages.advance(detail="rollout instances up")
        evaluation = plan.task.eval
        if self.heldout is not None and evaluation.during_training:
            reward_pool = self.reward_pool
            self.evals = EvalRounds(
                ray,
                self.control.driver,
                reward_pool.live,
                self.heldout,
                samples=evaluation.samples,
                k=evaluation.k,
            )
        resume_from = str(resume.checkpoint.trainer_dir) if resume is not None else ""
        trainer = trainer_spec(
            plan.trainer,
            spec,
            self.run_dir,
            seed=plan.seed,
            audit_log=rec.audit_log,
            resume_from=resume_from,
        )
        self.trainer = build_trainer(ctx, trainer, self.ps, self.control, recovery)
        stages.advance(detail="trainer up")
        if resume is not None:
            got = self.trainer.version()
            if got != version:
                raise LaunchError(
                    f"the trainer restored version {got} from {resume_from}, but the "
                    f"checkpoint is at version {version}: the checkpoint is inconsistent; "
                    "resume from an earlier one"
                )
        self.supervisor = self._supervise(self._supervised(), rec)
        if resume is not None:
            self.supervisor.redispatch_rewards()  # what was being scored at the stop
            self.control.driver.post_note(
                "resumed",
                "run",
                f"from {resume.checkpoint.path.name}: step {resume.steps}, version {version}",
            )
        self._report_weights(Layout.from_dict(spec.layout))

    def _supervised(self) -> Supervised:
        """The faces of the started pools that the supervisor acts on."""
        ctx, ps, resources = self.ctx, self.ps, self.plan.resources
        assert ctx is not None and self.control is not None and ps is not None
        assert self.reward_pool is not None and self.rollout is not None
        assert self.trainer is not None
        wait_s = min(resources.placement_timeout_s, 10.0)  # a scale request's placement
        bundle, tp = Bundle.of(resources.rollout), self.plan.rollout.tensor_parallel
        return supervised_pools(
            ctx,
            self.control,
            ps,
            self.reward_pool,
            self.rollout,
            self.trainer,
            run_dir=self.run_dir,
            new_slot=lambda inst: new_slot(ctx, bundle, tp, ps, inst, wait_s),
            phase=self._phase,
            resume_hint=self._resume_hint,
        )

    def _report_weights(self, layout: Layout) -> None:
        """Print the replicas, the Pulls and the Push plan with the transports chosen, and
        hand them to the control actor, where the dashboard and status read them."""

        assert self.ps is not None and self.trainer is not None and self.control is not None
        assert self.cluster is not None and self.placement is not None
        ray = self.cluster.ray
        pulls = dict(
            zip(
                [f"instance/{i}" for i in self.instances],
                ray.get([h.pull_route.remote() for h in self.instances.values()]),
                strict=True,
            )
        )
        pushes = self.trainer.push_transports()
        trainer_nodes = {rank: self.placement.node_of(rank) for rank in pushes}
        lines, weights = describe_weights(
            self.ps, pulls, pushes, layout, trainer_nodes, self.trainer.push_bytes()
        )
        for line in lines:
            self._phase(line)
        self.placement_info = {**self.placement.as_dict(), "weights": weights}
        self.control.driver.set_placement(self.placement_info)

    # -- watch -------------------------------------------------------------------------

    def train(
        self,
        steps: int,
        on_record: Callable[[StepRecord], None],
        on_tick: Callable[[Any], None] | None = None,
        poll_s: float = 0.5,
        stop: threading.Event | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Run ``steps`` training steps (fewer if ``stop`` is set: the run then stops
        gracefully); stream records; write the checkpoints the control plane cuts,
        the last one when the run stops or ends (``on_done`` is called before it);
        return the trainer's reports."""
        assert self.control is not None and self.trainer is not None and self.cluster is not None
        assert self.supervisor is not None
        ray = self.cluster.ray
        control = self.control.driver
        done_ref = self.trainer.run(steps)
        seen = self.steps_before
        stopping = False
        while True:
            ready, _ = ray.wait([done_ref], timeout=poll_s)
            try:
                new = control.records(seen)
                live = control.live() if on_tick is not None else None
                cut = control.pending_cut()
            except Exception as exc:  # named for the user below
                raise LaunchError(f"the control plane stopped: {cause(exc)}") from exc
            for rec in new:
                on_record(rec)
            seen += len(new)
            if on_tick is not None:
                on_tick(live)
            if cut is not None and not cut.final:
                self._write(cut)
            if self.evals is not None:
                self.evals.poll()
            if stop is not None and stop.is_set() and not stopping:
                self._phase("stopping: interrupting the rollouts, then checkpointing")
                control.request_stop()
                stopping = True
            if ready:
                break
            self.supervisor.tick()
        try:
            reports = ray.get(done_ref)
        except Exception as exc:
            raise LaunchError(f"the trainer stopped: {cause(exc)}; {self._resume_hint()}") from exc
        if on_done is not None:
            on_done()
        self.supervisor.heal_ps()  # the run ends with the last version on every replica
        control.request_stop()  # the end of the run is a stop, too
        self._write(self._final_cut())
        if self.evals is not None and self.evals.pending():  # it holds the last records
            self._phase("finishing the held-out evaluation (eval.every)")
            self.evals.finish()
        for rec in control.records(seen):
            on_record(rec)
        return reports

    def _final_cut(self, timeout_s: float = 600.0) -> Cut:
        assert self.control is not None
        deadline = time.monotonic() + timeout_s
        while True:
            cut = self.control.driver.pending_cut()
            if cut is not None and cut.final:
                return cut
            if time.monotonic() > deadline:
                raise LaunchError("the control plane took no final checkpoint cut")
            time.sleep(0.05)

    def _write(self, cut: Cut) -> Path:
        """Write one cut (the trainer writes its own part) and let training go on."""

        assert self.control is not None and self.trainer is not None
        trainer = self.trainer
        state = RunState(
            cut.steps, cut.version, cut.ps_version, cut.staleness, cut.trajectories, cut.metrics
        )
        try:
            path = write_checkpoint(
                self.run_dir,
                state,
                trainer=lambda folder: trainer.save_checkpoint(str(folder)),
                keep=self.plan.recovery.keep,
            )
        except Exception as exc:  # the earlier checkpoints are untouched: name them
            raise LaunchError(
                f"could not write the checkpoint of step {cut.steps}: {cause(exc)}; "
                f"{self._resume_hint()}"
            ) from exc
        self.checkpoints.append(path)
        control = self.control.driver
        control.post_note("checkpoint", "run", f"{path.name}: step {cut.steps}")
        control.post_release_cut(cut.steps)
        self._phase(f"checkpoint of step {cut.steps} written to {path}")
        return path

    def _resume_hint(self) -> str:

        found = list_checkpoints(self.run_dir)
        if not found:
            return "no checkpoint was written yet (set checkpoint_every to write them)"
        return f"resume with `staleflow launch --resume {self.run_dir}` (from {found[-1].name})"

    def audit(self) -> dict[str, Any]:
        """After training: stop routing, call every trajectory back to the TS and wait for
        the reward path, then count. Every trajectory ever created must be consumed,
        aborted, filtered (dynamic sampling), queued or completed in the TS, none left
        routed, rewarding or on an instance; and every PS replica must hold the trainer's last version
        (``ps_latest``).

        An actor may die here as anywhere else, and is handled as the run handles it: the
        instances counted are the control plane's members, and one found gone leaves the
        way a lost one does (its trajectories back in the TS with their versions and
        reservations); the supervisor replaces a lost reward worker (what it held is
        scored by another) and restarts a lost PS replica (refilled by the trainer)."""
        assert self.control is not None and self.cluster is not None and self.ps is not None
        control = self.control.driver
        control.stop()
        left = self._settle_instances()
        if self.supervisor is not None:
            self.supervisor.finish()
        stats = self.control.ts.stats()
        events = control.events()
        return {
            "ps_latest": self._ps_latest(),
            "created": stats.created_trajectories,
            "consumed": stats.consumed_trajectories,
            "aborted": stats.aborted_trajectories,
            "filtered": stats.filtered_trajectories,
            "filtered_groups": stats.filtered_groups,
            "queued": stats.queued,
            "routed": stats.routed,
            "rewarding": stats.rewarding,
            "completed": stats.completed,
            "on_instances": left,
            "recovery": dict(Counter(e.kind for e in events)),  # events by kind
        }

    def _settle_instances(self, rounds: int = 5) -> int:
        """The trajectories still on the control plane's members once each is
        interrupted and its hand-offs to reward workers are done; a member that died
        leaves the run (``ControlActor.settle``) and is not counted."""

        assert self.control is not None and self.cluster is not None
        ray, control = self.cluster.ray, self.control.driver
        for _ in range(rounds):
            members = control.settle()
            left, lost = 0, False
            for inst, h in sorted(members.items()):
                try:
                    held = ray.get(h.held.remote())
                    if held:
                        ray.get(h.interrupt.remote(sorted(held)))
                    ray.get(h.drain.remote())
                    left += len(ray.get(h.held.remote()))
                except Exception as exc:
                    dead = gone(inst, exc)
                    if dead is None:
                        raise
                    control.lost(inst, f"during the end-of-run audit: {dead.reason}")
                    lost = True
            if not lost:
                return left
        raise LaunchError(
            f"rollout instances kept dying during the end-of-run audit ({rounds} rounds)"
        )

    def _ps_latest(self, tries: int = 3) -> dict[str, int | None]:
        """Every replica's newest version; a replica lost meanwhile is restarted and
        refilled first (``Supervisor.heal_ps``)."""
        assert self.ps is not None and self.cluster is not None
        ray = self.cluster.ray
        for attempt in range(tries):
            replicas = dict(self.ps.actors)
            try:
                infos = ray.get([h.info.remote() for h in replicas.values()], timeout=120)
                return {role: info.latest for role, info in zip(replicas, infos, strict=True)}
            except Exception as exc:
                if self.supervisor is None or attempt == tries - 1:
                    raise LaunchError(
                        f"a PS replica did not answer the audit: {cause(exc)}"
                    ) from exc
                logger.warning("a PS replica did not answer the audit (%s): healing", cause(exc))
                self.supervisor.heal_ps()
        raise AssertionError("unreachable")

    def save_checkpoint(self, path: Path) -> None:
        assert self.trainer is not None
        self.trainer.save_checkpoint(str(path))

    # -- stop --------------------------------------------------------------------------

    def _teardown(self, what: str, step: Callable[[], object]) -> None:
        """One best-effort teardown step: a failure is logged, and the rest goes on."""
        try:
            step()
        except Exception as exc:
            logger.warning("teardown: could not %s: %s", what, cause(exc))

    def shutdown(self) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        ray = cluster.ray
        if self.control is not None:
            control = self.control.driver
            self._teardown("stop the control plane", lambda: control.stop(timeout_s=10))
        if self.supervisor is not None:
            self.supervisor.close()
        for i, h in self.instances.items():
            self._teardown(f"stop instance/{i}", lambda h=h: ray.get(h.stop.remote(), timeout=10))
        if self.trainer is not None:
            self._teardown("stop the trainer", self.trainer.stop)
        if self.ps is not None:
            for role, h in self.ps.actors.items():
                self._teardown(f"stop {role}", lambda h=h: ray.get(h.stop.remote(), timeout=10))
        for role, handle in _handles(self.actors):
            self._teardown(f"kill {role}", lambda handle=handle: ray.kill(handle))
        self.control, self.ps, self.reward_pool, self.rollout, self.trainer = (None,) * 5
        self.supervisor = None
        if self.reservation is not None:
            self.reservation.remove()
            self.reservation = None
        if self._own_cluster:
            cluster.shutdown()
            self.cluster = None


def _handles(actors: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for role, value in actors.items():
        if role == "ps":
            continue  # also in ps_replicas
        items = (
            value.items()
            if isinstance(value, dict)
            else enumerate(value)
            if isinstance(value, list)
            else [("", value)]
        )
        out.extend((f"{role}/{k}" if k != "" else role, h) for k, h in items)
    return out
