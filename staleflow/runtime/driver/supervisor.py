"""The supervisor: in the driver, between two looks at the run, it carries out what the
run cannot do for itself when an actor dies (``docs/recovery.md``).

- **A lost rollout instance** (the control plane noticed it and gave its trajectories
  back to the TS): killed for good, and started again under a new holder id, Pulling the
  PS's current version before it joins; after ``recovery.max_restarts`` restarts the run
  goes on without it. A restart never blocks the driver: the new actor is started, and
  joins at a later look once it is built.
- **A lost reward worker** (its ping fails): replaced; what it was scoring goes to a live
  worker (``reassign_rewards``); the completions it stored but never reported are
  applied; every instance learns the new set of workers.
- **A lost PS replica**: started again in its bundle, and refilled by the trainer.
- **Elastic rollout** (``staleflow scale``, the dashboard): instances are added the way a
  lost one is restarted, and removed the way a lost one leaves, after an interrupt that
  keeps their partial responses whole.

Every recovery is an event of the control plane's recovery log (the dashboard shows them)
and a ``recovery/*`` total in the step records. The supervisor also keeps
``RUN_DIR/live.json`` up to date: the Ray address and every actor's process id, for
``staleflow scale`` and for tests that kill processes.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from staleflow.runfolder.layout import RunLayout
from staleflow.runtime.driver.pools.parameter_server import respawn_replica
from staleflow.runtime.driver.pools.rewards import spawn_worker
from staleflow.runtime.driver.pools.rollout import new_slot, release_slot, spawn_instance
from staleflow.runtime.errors import LaunchError

if TYPE_CHECKING:
    from staleflow.config import RecoveryConfig
    from staleflow.runtime.driver.run import Run

logger = logging.getLogger(__name__)

SWEEP_S = 2.0  # how often REWARDING trajectories of dead workers are looked for again


@dataclass
class _Pending:
    """An instance being started: it joins once ``ready`` (its version) resolves."""

    actor: Any
    ready: Any  # ObjectRef of actor.version()
    kind: str  # instance_restarted | instance_added


class Supervisor:
    def __init__(self, run: Run, config: RecoveryConfig) -> None:
        assert run.ctx is not None and run.control is not None and run.cluster is not None
        self.run, self.config = run, config
        self.ray = run.cluster.ray
        self.control = run.control.control
        self.ts = run.control.ts
        self.restarts: dict[str, int] = {}  # role -> restarts so far
        self.pending: dict[int, _Pending] = {}
        self.removed: set[int] = set()  # left the run: their slots are free
        self.dead_workers: set[str] = set()  # worker ids whose REWARDING may need moving
        self._pings: dict[str, Any] = {}  # role or worker id -> ping in flight
        self._asked: list[tuple[str, Any]] = []  # requests to the control loop in flight
        self._ps_work: Future[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="supervisor")
        self._last_sweep = time.monotonic()
        self.write_live()

    # -- one look ------------------------------------------------------------------------

    def tick(self) -> None:
        """Everything a look at the run may find to do; never waits on the control
        loop, which may itself wait for what this restarts (a PS replica)."""
        self._parameter_server()
        self._instances()
        self._rewards()
        self._scale()
        self._settle()
        if time.monotonic() - self._last_sweep > SWEEP_S:
            self._last_sweep = time.monotonic()
            self._sweep_rewards()

    def live_instances(self) -> dict[int, Any]:
        rollout = self.run.rollout
        assert rollout is not None
        return {
            i: a
            for i, a in rollout.actors.items()
            if i not in self.pending and i not in self.removed
        }

    # -- rollout instances ---------------------------------------------------------------

    def _instances(self) -> None:
        for lost in self.ray.get(self.control.take_lost.remote()):
            self._restart(lost.inst, lost.reason)
        for inst, p in list(self.pending.items()):
            done, _ = self.ray.wait([p.ready], timeout=0)
            if not done:
                continue
            del self.pending[inst]
            try:
                version = self.ray.get(p.ready)
            except Exception as exc:  # it died while starting: try again
                self._restart(inst, f"died while starting: {_first_line(exc)}")
                continue
            rollout = self.run.rollout
            assert rollout is not None
            ref = self.control.join.remote(inst, p.actor, rollout.holders[inst], version, p.kind)
            self._asked.append((f"instance/{inst} to join", ref))
            self.write_live()

    def _restart(self, inst: int, reason: str) -> None:
        rollout = self.run.rollout
        assert rollout is not None
        self._kill(rollout.actors.get(inst))
        self._resend_rewarding()  # a hand-off it made may never have reached its worker
        if inst in self.removed:
            return
        role = f"instance/{inst}"
        n = self.restarts.get(role, 0) + 1
        if n > self.config.max_restarts:
            self.removed.add(inst)
            self._note("instance_given_up", role, f"{n - 1} restarts used; last: {reason}")
            if not self.live_instances() and not self.pending:
                raise LaunchError(
                    f"every rollout instance was lost ({role}: {reason}) and out of restarts "
                    f"(recovery.max_restarts={self.config.max_restarts}); "
                    f"{self.run._resume_hint()}"
                )
            return
        self.restarts[role] = n
        self._start_instance(inst, n, "instance_restarted")

    def _start_instance(self, inst: int, incarnation: int, kind: str) -> None:

        run = self.run
        assert run.ctx and run.rollout and run.ps and run.control and run.reward_pool
        latest = self.ray.get(self.control.live.remote()).ps_version
        actor = spawn_instance(
            run.ctx,
            run.rollout,
            inst,
            incarnation,
            run.ps,
            run.control,
            run.reward_pool.live(),
            latest,
        )
        self.pending[inst] = _Pending(actor, actor.version.remote(), kind)
        logger.info("instance %d: incarnation %d starting (%s)", inst, incarnation, kind)

    # -- reward workers ------------------------------------------------------------------

    def _rewards(self) -> None:
        pool = self.run.reward_pool
        assert pool is not None
        for wid, actor in list(pool.workers.items()):
            error = self._ping(wid, actor.ping)
            if error is not None:
                self._lose_worker(wid, actor, error)
                # the completions it stored but never reported are applied on the loop
                self._asked.append(("a replay", self.control.replay_completions.remote()))

    def _lose_worker(self, wid: str, actor: Any, error: str) -> int:
        """Replace a dead reward worker; what it held goes to a live one (returns how
        many)."""
        pool = self.run.reward_pool
        assert pool is not None
        self._kill(actor)
        del pool.workers[wid]
        self.dead_workers.add(wid)
        role = pool.role_of[wid]
        n = self.restarts.get(role, 0) + 1
        if n <= self.config.max_restarts:
            assert self.run.ctx is not None and self.run.control is not None
            self.restarts[role] = n
            spawn_worker(self.run.ctx, pool, role, n, self.run.control)
        if not pool.workers:
            raise LaunchError(
                f"every reward worker was lost ({role}: {error}) and out of restarts; "
                f"{self.run._resume_hint()}"
            )
        for inst_actor in self.live_instances().values():
            inst_actor.set_rewards.remote(pool.live())
        moved = self._sweep_rewards()
        self._note(
            "reward_worker_lost",
            role,
            f"{wid}: {error}; {moved} trajectories scored elsewhere",
            reassigned=moved,
        )
        if n <= self.config.max_restarts:
            self._note("reward_worker_restarted", role, f"incarnation {n}")
        self.write_live()
        return moved

    # -- the end of the run --------------------------------------------------------------

    def finish(self, timeout_s: float = 120.0) -> None:
        """The end of the run, once the control loop stopped and every instance was
        settled (``Run.audit``): the instances the control plane gave up on leave
        without a restart, and those still starting are stopped, so the supervisor's
        instances are the control plane's members again; every reward worker answers
        or is replaced, and what the dead ones held is scored (waited for); every PS
        replica holds the last version."""
        rollout = self.run.rollout
        assert rollout is not None
        for lost in self.ray.get(self.control.take_lost.remote()):
            self._kill(rollout.actors.get(lost.inst))
            self.removed.add(lost.inst)
        for inst, p in self.pending.items():
            self._kill(p.actor)
            self.removed.add(inst)
        self.pending.clear()
        members = set(self.ray.get(self.control.members.remote()))
        if set(self.live_instances()) != members:  # a death the audit has not settled
            logger.warning("instances %s vs members %s", sorted(self.live_instances()), members)
        self._settle_rewards(timeout_s)
        self.heal_ps()
        self.write_live()

    def _settle_rewards(self, timeout_s: float) -> None:
        """Until the TS holds nothing REWARDING: ping every worker (replacing the dead
        ones) and have a live worker score what dead ones held. The control loop has
        stopped: the completions land in the TS, which is what the audit counts."""
        pool = self.run.reward_pool
        assert pool is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for wid, actor in list(pool.workers.items()):
                try:
                    self.ray.get(actor.ping.remote(), timeout=60)
                except self.ray.exceptions.GetTimeoutError:
                    continue  # still starting, or busy scoring: asked again next round
                except Exception as exc:
                    self._lose_worker(wid, actor, _first_line(exc))
            if self.ray.get(self.ts.handle.stats.remote()).rewarding == 0:
                return
            first = next(iter(pool.workers))
            moves = [(dead, first) for dead in self.dead_workers]
            moves += [(w, w) for w in pool.workers]  # sent before, maybe never arrived
            refs = []
            for src, dst in moves:
                tasks = self.ts.reassign_rewards(src, dst)
                if tasks:
                    refs.append(pool.workers[dst].process_tasks.remote(list(tasks)))
            try:
                self.ray.get(refs, timeout=max(deadline - time.monotonic(), 1.0))
            except Exception as exc:  # it died too: the next round replaces it
                logger.warning("scoring at the end of the run failed: %s", _first_line(exc))
        logger.warning("trajectories still rewarding after %g s at the end of the run", timeout_s)

    def redispatch_rewards(self) -> int:
        """After a resume: what was being scored at the stop goes to a live worker."""
        return self._move_rewarding(None)

    def _sweep_rewards(self) -> int:
        """REWARDING trajectories still held by dead workers (a hand-off that raced with
        the reassignment) go to live ones."""
        return sum(self._move_rewarding(wid) for wid in self.dead_workers)

    def _move_rewarding(self, from_worker: str | None) -> int:
        pool = self.run.reward_pool
        assert pool is not None
        if not pool.workers:
            return 0
        wid, worker = next(iter(pool.workers.items()))
        tasks = self.ts.reassign_rewards(from_worker, wid)
        if tasks:
            worker.process_tasks.remote(list(tasks))
        return len(tasks)

    def _resend_rewarding(self) -> None:
        """An instance died: a hand-off to a live worker it recorded in the TS may not
        have reached the worker. Send every worker what the TS says it scores; a second
        score of the same trajectory is refused by the TS and dropped."""
        pool = self.run.reward_pool
        assert pool is not None
        for wid, worker in pool.workers.items():
            tasks = self.ts.reassign_rewards(wid, wid)
            if tasks:
                worker.process_tasks.remote(list(tasks))

    # -- parameter server ----------------------------------------------------------------

    def _parameter_server(self) -> None:
        ps = self.run.ps
        assert ps is not None
        if self._ps_work is not None:
            if not self._ps_work.done():
                return
            work, self._ps_work = self._ps_work, None
            work.result()  # a restart that failed stops the run, naming why
        for role, actor in list(ps.actors.items()):
            error = self._ping(role, actor.alive)
            if error is not None:
                self._ps_work = self._pool.submit(self._restart_replica, role, error)
                return

    def heal_ps(self, timeout_s: float = 120.0) -> None:
        """At the end of training: finish a replica's restart in flight, and restart (and
        refill) any replica that died since the last look. A Megatron pool's ranks go on
        without a lost replica until it is back, so the last version may have missed it."""
        if self._ps_work is not None:
            work, self._ps_work = self._ps_work, None
            work.result()
        ps = self.run.ps
        assert ps is not None
        for role, actor in list(ps.actors.items()):
            try:
                alive = self.ray.get(actor.alive.remote(), timeout=timeout_s)
            except self.ray.exceptions.RayActorError as exc:
                self._restart_replica(role, _first_line(exc))
                continue
            except self.ray.exceptions.GetTimeoutError:
                logger.warning("PS replica %s did not answer within %g s", role, timeout_s)
                continue
            if alive is False:
                self._restart_replica(role, "its worker process exited")

    def _restart_replica(self, role: str, error: str) -> None:

        run = self.run
        assert run.ctx is not None and run.ps is not None and run.trainer is not None
        n = self.restarts.get(role, 0) + 1
        if n > self.config.max_restarts:
            raise LaunchError(
                f"PS replica {role} was lost ({error}) and is out of restarts "
                f"(recovery.max_restarts={self.config.max_restarts}); {run._resume_hint()}"
            )
        self.restarts[role] = n
        self._note("ps_lost", role, error)
        old = run.ps.actors.get(role)
        if old is not None:  # a live actor whose worker died: it frees the worker's memory
            try:
                self.ray.get(old.stop.remote(), timeout=30)
            except Exception:
                logger.debug("PS replica %s could not stop its worker", role, exc_info=True)
        self._kill(old)
        respawn_replica(run.ctx, run.ps, role)
        run.trainer.refill_ps()
        self._note("ps_restarted", role, f"incarnation {n}, refilled by the trainer")
        self.write_live()

    # -- elastic rollout -----------------------------------------------------------------

    def _scale(self) -> None:
        target = self.ray.get(self.control.take_scale.remote())
        if target is not None:
            self.scale(target)

    def scale(self, target: int) -> str:
        """Add or remove instances until ``target`` are in the run (or starting); an
        instance that cannot be placed is refused with the reason (an event)."""
        target = max(1, target)
        live = sorted(self.live_instances())
        have = len(live) + len(self.pending)
        if target > have:
            for _ in range(target - have):
                try:
                    self._add_instance()
                except LaunchError as exc:
                    self._note("scale_refused", "run", str(exc))
                    return f"refused: {exc}"
            return f"adding {target - have} rollout instance(s)"
        excess = min(have - target, len(live) - 1)  # keep one instance at least
        for inst in live[len(live) - excess :] if excess > 0 else []:
            self._remove_instance(inst)
        return f"removed {max(excess, 0)} rollout instance(s)"

    def _add_instance(self) -> None:

        rollout = self.run.rollout
        assert rollout is not None and self.run.ctx is not None and self.run.ps is not None
        free = sorted(i for i in self.removed if i in rollout.slots)
        if free:  # the slot of an instance that left: a new incarnation there
            inst = free[0]
            incarnation = self.restarts.get(f"instance/{inst}", 0) + 1
        else:
            inst = max(rollout.slots, default=-1) + 1
            wait_s = min(self.run.cfg.resources.placement_timeout_s, 10.0)
            rollout.slots[inst] = new_slot(self.run.ctx, self.run.cfg, self.run.ps, inst, wait_s)
            incarnation = 0
        self.removed.discard(inst)
        self.restarts[f"instance/{inst}"] = incarnation
        self._start_instance(inst, incarnation, "instance_added")

    def _remove_instance(self, inst: int) -> None:
        rollout = self.run.rollout
        assert rollout is not None
        self.ray.get(self.control.remove.remote(inst))
        self.removed.add(inst)
        actor = rollout.actors.get(inst)
        if actor is not None:
            try:
                self.ray.get(actor.stop.remote(), timeout=10)
            except Exception as exc:
                logger.info("instance %d did not stop cleanly: %s", inst, _first_line(exc))
            self._kill(actor)
        self.write_live()

    # -- helpers -------------------------------------------------------------------------

    def _settle(self) -> None:
        """Requests the control loop has carried out since: one that failed stops the
        run, naming it."""
        still = []
        for what, ref in self._asked:
            done, _ = self.ray.wait([ref], timeout=0)
            if not done:
                still.append((what, ref))
                continue
            try:
                self.ray.get(ref)
            except Exception as exc:
                raise LaunchError(f"the control plane failed {what}: {_first_line(exc)}") from exc
        self._asked = still

    def _ping(self, key: str, method: Any) -> str | None:
        """None while ``key`` is alive (or busy: a ping still pending is left alone);
        the error when its last ping failed."""
        ref = self._pings.get(key)
        if ref is None:
            self._pings[key] = method.remote()
            return None
        done, _ = self.ray.wait([ref], timeout=0)
        if not done:
            return None
        del self._pings[key]
        try:
            answer = self.ray.get(ref)
        except Exception as exc:
            return _first_line(exc)
        if answer is False:  # the actor lives, what it serves does not (a PS worker process)
            return "its actor answers, but says what it serves has exited"
        return None

    def _kill(self, actor: Any) -> None:
        if actor is None:
            return
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone
            logger.debug("kill: %s", exc)

    def _note(self, kind: str, subject: str, detail: str, **amounts: float) -> None:
        logger.warning("recovery: %s %s: %s", kind, subject, detail)
        self.run._phase(f"recovery: {kind.replace('_', ' ')} {subject}: {detail}")
        self.ray.get(self.control.note.remote(kind, subject, detail, **amounts))

    def write_live(self) -> None:
        """``RUN_DIR/live.json``: how to reach the run, and its actors' process ids."""
        run = self.run
        roles: dict[str, Any] = {}
        if run.rollout is not None:
            roles.update({f"instance/{i}": a for i, a in self.live_instances().items()})
        if run.reward_pool is not None:
            roles.update(
                {run.reward_pool.role_of[w]: a for w, a in run.reward_pool.workers.items()}
            )
        if run.ps is not None:
            roles.update(run.ps.actors)
        if run.trainer is not None:
            roles.update(run.trainer.handles())
        pids = {}
        for role, actor in roles.items():
            try:
                pids[role] = self.ray.get(actor.pid.remote(), timeout=30)
            except Exception as exc:  # dying: its successor is written next time
                logger.debug("no pid for %s: %s", role, exc)
        info = {
            "run": run.run_dir.name,
            "ray_address": _gcs_address(self.ray),
            "driver_pid": os.getpid(),
            "pids": pids,
        }
        RunLayout(run.run_dir).write_live(info)

    def close(self) -> None:

        self._pool.shutdown(wait=True)
        for p in self.pending.values():
            self._kill(p.actor)
        if self.run.rollout is not None:
            for slot in self.run.rollout.slots.values():
                try:
                    release_slot(slot)
                except Exception as exc:  # the run is ending; the cluster reclaims it
                    logger.debug("placement group of %s: %s", slot.role, exc)
        RunLayout(self.run.run_dir).remove_live()


def _gcs_address(ray: Any) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return ""


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else repr(exc))[:300]
