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
and a ``recovery/*`` total in the step records. The supervisor sees the run only through
the faces of :mod:`staleflow.runtime.driver.supervised` (Ray's are
:mod:`staleflow.runtime.driver.supervised_ray`), so its decisions are unit-tested over
fakes (``tests/staleflow/runtime/driver/test_supervisor.py``). The supervisor also keeps
``RUN_DIR/live.json`` up to date: the Ray address and every actor's process id, for
``staleflow scale`` and for tests that kill processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from staleflow.runtime.driver.supervised import ActorGone, Handle, Pending, Supervised
from staleflow.runtime.errors import LaunchError

if TYPE_CHECKING:
    from staleflow.config import RecoveryConfig

logger = logging.getLogger(__name__)

SWEEP_S = 2.0  # how often REWARDING trajectories of dead workers are looked for again


@dataclass
class _Pending:
    """An instance being started: it joins once ``ready`` (its version) resolves."""

    ready: Pending[int]
    kind: str  # instance_restarted | instance_added


class Supervisor:
    """``run``: the faces of the run's pools and control actor; ``clock``: seconds that
    only go forward; ``executor``: where a PS replica's restart runs (it waits for the
    replica, and the trainer's refill), one at a time, off the driver's loop."""

    def __init__(
        self,
        run: Supervised,
        config: RecoveryConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
    ) -> None:
        self.run, self.config, self.clock = run, config, clock
        self.rollout, self.rewards, self.ps = run.rollout, run.rewards, run.ps
        self.control, self.ts = run.control, run.ts
        self.restarts: dict[str, int] = {}  # role -> restarts so far
        self.pending: dict[int, _Pending] = {}
        self.removed: set[int] = set()  # left the run: their slots are free
        self.dead_workers: set[str] = set()  # worker ids whose REWARDING may need moving
        self._pings: dict[str, Pending[object]] = {}  # role or worker id -> ping in flight
        self._asked: list[tuple[str, Pending[object]]] = []  # requests to the control loop
        self._ps_work: Future[None] | None = None
        self._pool = executor or ThreadPoolExecutor(1, thread_name_prefix="supervisor")
        self._last_sweep = clock()
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
        if self.clock() - self._last_sweep > SWEEP_S:
            self._last_sweep = self.clock()
            self._sweep_rewards()

    def live_instances(self) -> list[int]:
        """The instances in the run, by id: started, not starting, not left."""
        return sorted(
            i for i in self.rollout.started() if i not in self.pending and i not in self.removed
        )

    # -- rollout instances ---------------------------------------------------------------

    def _instances(self) -> None:
        for lost in self.control.take_lost():
            self._restart(lost.inst, lost.reason)
        for inst, p in list(self.pending.items()):
            if not p.ready.done():
                continue
            del self.pending[inst]
            try:
                version = p.ready.result()
            except Exception as exc:  # it died while starting: try again
                self._restart(inst, f"died while starting: {_first_line(exc)}")
                continue
            ref = self.control.submit_join(
                inst, self.rollout.handle(inst), self.rollout.holder(inst), version, p.kind
            )
            self._asked.append((f"instance/{inst} to join", ref))
            self.write_live()

    def _restart(self, inst: int, reason: str) -> None:
        self.rollout.kill(inst)
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
                    f"{self.run.resume_hint()}"
                )
            return
        self.restarts[role] = n
        self._start_instance(inst, n, "instance_restarted")

    def _start_instance(self, inst: int, incarnation: int, kind: str) -> None:
        latest = self.control.live().ps_version
        ready = self.rollout.spawn(inst, incarnation, self.rewards.live(), latest)
        self.pending[inst] = _Pending(ready, kind)
        logger.info("instance %d: incarnation %d starting (%s)", inst, incarnation, kind)

    # -- reward workers ------------------------------------------------------------------

    def _rewards(self) -> None:
        for wid in list(self.rewards.live()):
            error = self._ping(wid, lambda wid=wid: self.rewards.ping(wid))
            if error is not None:
                self._lose_worker(wid, error)
                # the completions it stored but never reported are applied on the loop
                self._asked.append(("a replay", self.control.submit_replay_completions()))

    def _lose_worker(self, wid: str, error: str) -> int:
        """Replace a dead reward worker; what it held goes to a live one (returns how
        many)."""
        role = self.rewards.role_of(wid)
        self.rewards.remove(wid)
        self.dead_workers.add(wid)
        n = self.restarts.get(role, 0) + 1
        if n <= self.config.max_restarts:
            self.restarts[role] = n
            self.rewards.spawn(role, n)
        workers = self.rewards.live()
        if not workers:
            raise LaunchError(
                f"every reward worker was lost ({role}: {error}) and out of restarts; "
                f"{self.run.resume_hint()}"
            )
        for inst in self.live_instances():
            self.rollout.set_rewards(inst, workers)
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
        for lost in self.control.take_lost():
            self.rollout.kill(lost.inst)
            self.removed.add(lost.inst)
        for inst in self.pending:
            self.rollout.kill(inst)
            self.removed.add(inst)
        self.pending.clear()
        members = set(self.control.members())
        if set(self.live_instances()) != members:  # a death the audit has not settled
            logger.warning("instances %s vs members %s", self.live_instances(), sorted(members))
        self._settle_rewards(timeout_s)
        self.heal_ps()
        self.write_live()

    def _settle_rewards(self, timeout_s: float) -> None:
        """Until the TS holds nothing REWARDING: ping every worker (replacing the dead
        ones) and have a live worker score what dead ones held. The control loop has
        stopped: the completions land in the TS, which is what the audit counts."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            for wid in list(self.rewards.live()):
                try:
                    self.rewards.ping(wid).result(timeout_s=60)
                except TimeoutError:
                    continue  # still starting, or busy scoring: asked again next round
                except Exception as exc:
                    self._lose_worker(wid, _first_line(exc))
            if self.ts.stats().rewarding == 0:
                return
            workers = list(self.rewards.live())
            moves = [(dead, workers[0]) for dead in self.dead_workers]
            moves += [(w, w) for w in workers]  # sent before, maybe never arrived
            scoring = []
            for src, dst in moves:
                tasks = self.ts.reassign_rewards(src, dst)
                if tasks:
                    scoring.append(self.rewards.score(dst, tasks))
            try:
                for call in scoring:
                    call.result(timeout_s=max(deadline - self.clock(), 1.0))
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
        workers = self.rewards.live()
        if not workers:
            return 0
        wid = next(iter(workers))
        tasks = self.ts.reassign_rewards(from_worker, wid)
        if tasks:
            self.rewards.score(wid, tasks)
        return len(tasks)

    def _resend_rewarding(self) -> None:
        """An instance died: a hand-off to a live worker it recorded in the TS may not
        have reached the worker. Send every worker what the TS says it scores; a second
        score of the same trajectory is refused by the TS and dropped."""
        for wid in list(self.rewards.live()):
            tasks = self.ts.reassign_rewards(wid, wid)
            if tasks:
                self.rewards.score(wid, tasks)

    # -- parameter server ----------------------------------------------------------------

    def _parameter_server(self) -> None:
        if self._ps_work is not None:
            if not self._ps_work.done():
                return
            work, self._ps_work = self._ps_work, None
            work.result()  # a restart that failed stops the run, naming why
        for role in list(self.ps.handles()):
            error = self._ping(role, lambda role=role: self.ps.alive(role))
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
        for role in list(self.ps.handles()):
            try:
                alive = self.ps.alive(role).result(timeout_s=timeout_s)
            except ActorGone as exc:
                self._restart_replica(role, _first_line(exc))
                continue
            except TimeoutError:
                logger.warning("PS replica %s did not answer within %g s", role, timeout_s)
                continue
            if alive is False:
                self._restart_replica(role, "its worker process exited")

    def _restart_replica(self, role: str, error: str) -> None:
        n = self.restarts.get(role, 0) + 1
        if n > self.config.max_restarts:
            raise LaunchError(
                f"PS replica {role} was lost ({error}) and is out of restarts "
                f"(recovery.max_restarts={self.config.max_restarts}); {self.run.resume_hint()}"
            )
        self.restarts[role] = n
        self._note("ps_lost", role, error)
        try:  # a live actor whose worker died: it frees the worker's memory
            self.ps.stop(role, 30)
        except Exception:
            logger.debug("PS replica %s could not stop its worker", role, exc_info=True)
        self.ps.kill(role)
        self.ps.respawn(role)
        self.run.trainer.refill_ps()
        self._note("ps_restarted", role, f"incarnation {n}, refilled by the trainer")
        self.write_live()

    # -- elastic rollout -----------------------------------------------------------------

    def _scale(self) -> None:
        target = self.control.take_scale()
        if target is not None:
            self.scale(target)

    def scale(self, target: int) -> str:
        """Add or remove instances until ``target`` are in the run (or starting); an
        instance that cannot be placed is refused with the reason (an event)."""
        target = max(1, target)
        live = self.live_instances()
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
        slots = self.rollout.slots()
        free = sorted(i for i in self.removed if i in slots)
        if free:  # the slot of an instance that left: a new incarnation there
            inst = free[0]
            incarnation = self.restarts.get(f"instance/{inst}", 0) + 1
        else:
            inst = max(slots, default=-1) + 1
            self.rollout.add_slot(inst)
            incarnation = 0
        self.removed.discard(inst)
        self.restarts[f"instance/{inst}"] = incarnation
        self._start_instance(inst, incarnation, "instance_added")

    def _remove_instance(self, inst: int) -> None:
        self.control.remove(inst)
        self.removed.add(inst)
        if inst in self.rollout.started():
            try:
                self.rollout.stop(inst, 10)
            except Exception as exc:
                logger.info("instance %d did not stop cleanly: %s", inst, _first_line(exc))
            self.rollout.kill(inst)
        self.write_live()

    # -- helpers -------------------------------------------------------------------------

    def _settle(self) -> None:
        """Requests the control loop has carried out since: one that failed stops the
        run, naming it."""
        still = []
        for what, call in self._asked:
            if not call.done():
                still.append((what, call))
                continue
            try:
                call.result()
            except Exception as exc:
                raise LaunchError(f"the control plane failed {what}: {_first_line(exc)}") from exc
        self._asked = still

    def _ping(self, key: str, ask: Callable[[], Pending[object]]) -> str | None:
        """None while ``key`` is alive (or busy: a ping still pending is left alone);
        the error when its last ping failed."""
        call = self._pings.get(key)
        if call is None:
            self._pings[key] = ask()
            return None
        if not call.done():
            return None
        del self._pings[key]
        try:
            answer = call.result()
        except Exception as exc:
            return _first_line(exc)
        if answer is False:  # the actor lives, what it serves does not (a PS worker process)
            return "its actor answers, but says what it serves has exited"
        return None

    def _note(self, kind: str, subject: str, detail: str, **amounts: float) -> None:
        logger.warning("recovery: %s %s: %s", kind, subject, detail)
        self.run.phase(f"recovery: {kind.replace('_', ' ')} {subject}: {detail}")
        self.control.note(kind, subject, detail, **amounts)

    def write_live(self) -> None:
        """``RUN_DIR/live.json``: how to reach the run, and its actors' process ids."""
        roles: dict[str, Handle] = {
            f"instance/{i}": self.rollout.handle(i) for i in self.live_instances()
        }
        roles.update({self.rewards.role_of(w): a for w, a in self.rewards.live().items()})
        roles.update(self.ps.handles())
        roles.update(self.run.trainer.handles())
        self.run.live.write(roles)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for inst in self.pending:
            self.rollout.kill(inst)
        self.rollout.release_slots()
        self.run.live.remove()


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else repr(exc))[:300]
