"""Fakes of what the supervisor acts on (``staleflow.runtime.driver.supervised``), for
its unit tests without Ray or processes.

Faked: the actors behind each face (rollout instances, reward workers, PS replicas, the
trainer), the control actor, the trajectory server's REWARDING trajectories, live.json,
the clock, and the thread a PS restart runs on (:class:`InlineExecutor` runs it at
once). Each fake records what it was asked; calls in flight are :class:`Call`, resolved
when the test says so. The supervisor's code is the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from staleflow.config import RecoveryConfig
from staleflow.runtime.controller.fleet import LostInstance
from staleflow.runtime.driver.supervised import ActorGone, Supervised
from staleflow.runtime.driver.supervisor import Supervisor
from staleflow.runtime.errors import LaunchError

_UNSET = object()


class Call:
    """A call in flight: done once resolved or failed."""

    def __init__(self, value: Any = _UNSET, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def resolve(self, value: Any = None) -> None:
        self._value = value

    def fail(self, error: BaseException) -> None:
        self._error = error

    def done(self) -> bool:
        return self._error is not None or self._value is not _UNSET

    def result(self, timeout_s: float | None = None) -> Any:
        if not self.done():
            raise TimeoutError(f"not done within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value


class FakeClock:
    """Seconds set by the test; with ``step``, each reading moves it on by that much (a
    loop that waits on the clock then ends)."""

    def __init__(self) -> None:
        self.now, self.step = 0.0, 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class InlineExecutor:
    """Runs what is submitted at once (a PS restart), so a test needs no thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        out: Future[Any] = Future()
        try:
            out.set_result(fn(*args))
        except BaseException as exc:
            out.set_exception(exc)
        return out

    def shutdown(self, wait: bool = True) -> None:
        pass


@dataclass
class FakeFleet:
    """Instances ``0..n-1``; an actor is the string ``actor-<inst>.<incarnation>``."""

    n: int
    actors: dict[int, str] = field(default_factory=dict)
    holders: dict[int, str] = field(default_factory=dict)
    slot_ids: set[int] = field(default_factory=set)
    starting: dict[int, Call] = field(default_factory=dict)  # the newest spawn's readiness
    spawned: list[tuple[int, int, dict[str, Any], int]] = field(default_factory=list)
    told: dict[int, dict[str, Any]] = field(default_factory=dict)  # the workers it knows
    killed: list[str] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    room: bool = True  # whether a slot can be added
    released: bool = False

    def __post_init__(self) -> None:
        for i in range(self.n):
            self.actors[i], self.holders[i] = f"actor-{i}.0", f"{i}.0"
            self.slot_ids.add(i)

    def started(self) -> list[int]:
        return list(self.actors)

    def handle(self, inst: int) -> str:
        return self.actors[inst]

    def holder(self, inst: int) -> str:
        return self.holders[inst]

    def slots(self) -> set[int]:
        return set(self.slot_ids)

    def add_slot(self, inst: int) -> None:
        if not self.room:
            raise LaunchError("no room for another rollout instance: free resources")
        self.slot_ids.add(inst)

    def spawn(self, inst: int, incarnation: int, rewards: Mapping[str, Any], at_least: int) -> Call:
        self.actors[inst], self.holders[inst] = (
            f"actor-{inst}.{incarnation}",
            f"{inst}.{incarnation}",
        )
        self.spawned.append((inst, incarnation, dict(rewards), at_least))
        self.starting[inst] = Call()
        return self.starting[inst]

    def set_rewards(self, inst: int, rewards: Mapping[str, Any]) -> None:
        self.told[inst] = dict(rewards)

    def stop(self, inst: int, timeout_s: float) -> None:
        self.stopped.append(inst)

    def kill(self, inst: int) -> None:
        if inst in self.actors:
            self.killed.append(self.actors[inst])

    def release_slots(self) -> None:
        self.released = True


@dataclass
class FakeLedger:
    """The TS's REWARDING trajectories: trajectory id -> its worker id (None: none)."""

    rewarding: dict[int, str | None] = field(default_factory=dict)

    def reassign_rewards(self, from_worker: str | None, to_worker: str | None) -> list[int]:
        moved = [t for t, w in self.rewarding.items() if w == from_worker]
        for t in moved:
            self.rewarding[t] = to_worker
        return moved  # the tasks: their trajectory ids

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(rewarding=len(self.rewarding))


@dataclass
class FakeRewards:
    """Workers ``reward/<w>.<k>``; a dead one's ping fails, a hung one's never returns.
    A live worker scores what it is sent (it leaves the ledger) unless ``scores`` is off."""

    ledger: FakeLedger
    workers: dict[str, str] = field(default_factory=dict)  # worker id -> actor
    roles: dict[str, str] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    hung: set[str] = field(default_factory=set)
    removed: list[str] = field(default_factory=list)
    sent: list[tuple[str, list[int]]] = field(default_factory=list)
    pings: int = 0
    scores: bool = True

    def add(self, role: str, incarnation: int = 0) -> str:
        wid = f"{role}.{incarnation}"
        self.workers[wid], self.roles[wid] = f"actor-{wid}", role
        return wid

    def live(self) -> dict[str, str]:
        return dict(self.workers)

    def role_of(self, wid: str) -> str:
        return self.roles[wid]

    def ping(self, wid: str) -> Call:
        self.pings += 1
        if wid in self.dead:
            return Call(error=ActorGone(f"The actor {wid} died unexpectedly"))
        return Call() if wid in self.hung else Call(True)

    def spawn(self, role: str, incarnation: int) -> str:
        return self.add(role, incarnation)

    def remove(self, wid: str) -> None:
        del self.workers[wid]
        self.removed.append(wid)

    def score(self, wid: str, tasks: Sequence[int]) -> Call:
        self.sent.append((wid, list(tasks)))
        if wid in self.dead:
            return Call(error=ActorGone(f"The actor {wid} died unexpectedly"))
        if self.scores:
            for t in tasks:
                if self.ledger.rewarding.get(t) == wid:
                    del self.ledger.rewarding[t]
        return Call(None)


@dataclass
class FakeParameterServers:
    """Replicas ``ps/<k>``; a dead one's ping fails, one whose worker died answers False."""

    n: int
    incarnation: dict[str, int] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    worker_dead: set[str] = field(default_factory=set)
    hung: set[str] = field(default_factory=set)
    stopped: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.incarnation = {f"ps/{k}": 0 for k in range(self.n)}

    def handles(self) -> dict[str, str]:
        return {role: f"actor-{role}#{k}" for role, k in self.incarnation.items()}

    def alive(self, role: str) -> Call:
        if role in self.dead:
            return Call(error=ActorGone(f"The actor {role} died unexpectedly"))
        return Call() if role in self.hung else Call(role not in self.worker_dead)

    def stop(self, role: str, timeout_s: float) -> None:
        if role in self.dead:
            raise ActorGone(f"The actor {role} died unexpectedly")
        self.stopped.append(role)

    def kill(self, role: str) -> None:
        self.killed.append(self.handles()[role])

    def respawn(self, role: str) -> None:
        self.incarnation[role] += 1
        self.dead.discard(role)
        self.worker_dead.discard(role)


@dataclass
class FakeTrainer:
    refills: int = 0

    def handles(self) -> dict[str, str]:
        return {"trainer/0": "actor-trainer/0"}

    def refill_ps(self) -> None:
        self.refills += 1


@dataclass
class FakeControl:
    """The control actor's supervisor face: members, lost instances, requests."""

    member_ids: set[int]
    ps_version: int = 3
    lost_queue: list[LostInstance] = field(default_factory=list)
    joins: list[tuple[int, Any, str, int, str]] = field(default_factory=list)
    join_calls: list[Call] = field(default_factory=list)
    join_done: bool = True  # whether a join is carried out at once
    removed: list[int] = field(default_factory=list)
    replays: list[Call] = field(default_factory=list)
    replay_error: BaseException | None = None  # a replay the control loop fails
    scale_to: int | None = None
    notes: list[tuple[str, str, str, dict[str, float]]] = field(default_factory=list)

    def lose(self, inst: int, holder: str, reason: str = "its actor died") -> None:
        """What the control plane does when it notices a lost instance."""
        self.member_ids.discard(inst)
        self.lost_queue.append(LostInstance(inst, holder, reason))

    def take_lost(self) -> list[LostInstance]:
        out, self.lost_queue = self.lost_queue, []
        return out

    def live(self, timeout_s: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(ps_version=self.ps_version)

    def submit_join(self, inst: int, actor: Any, holder: str, version: int, kind: str) -> Call:
        self.joins.append((inst, actor, holder, version, kind))
        call = Call(None) if self.join_done else Call()
        self.join_calls.append(call)
        if self.join_done:
            self.member_ids.add(inst)
        return call

    def remove(self, inst: int) -> int:
        self.removed.append(inst)
        self.member_ids.discard(inst)
        return 0

    def members(self, timeout_s: float | None = None) -> dict[int, Any]:
        return dict.fromkeys(self.member_ids)

    def submit_replay_completions(self) -> Call:
        self.replays.append(Call(error=self.replay_error) if self.replay_error else Call(0))
        return self.replays[-1]

    def take_scale(self) -> int | None:
        out, self.scale_to = self.scale_to, None
        return out

    def note(self, kind: str, subject: str, detail: str = "", **amounts: float) -> None:
        self.notes.append((kind, subject, detail, amounts))

    def kinds(self) -> list[str]:
        return [kind for kind, *_ in self.notes]


@dataclass
class FakeLive:
    writes: list[dict[str, Any]] = field(default_factory=list)
    removed: bool = False

    def write(self, actors: Mapping[str, Any]) -> None:
        self.writes.append(dict(actors))

    def remove(self) -> None:
        self.removed = True


@dataclass
class Harness:
    """A supervisor over fakes of a run with ``instances`` rollout instances, ``workers``
    reward workers and ``replicas`` PS replicas."""

    supervisor: Supervisor
    clock: FakeClock
    rollout: FakeFleet
    rewards: FakeRewards
    ledger: FakeLedger
    ps: FakeParameterServers
    trainer: FakeTrainer
    control: FakeControl
    live: FakeLive
    phases: list[str]


def harness(
    instances: int = 2, workers: int = 1, replicas: int = 1, max_restarts: int = 2
) -> Harness:
    clock, ledger = FakeClock(), FakeLedger()
    rollout, rewards = FakeFleet(instances), FakeRewards(ledger)
    for w in range(workers):
        rewards.add(f"reward/{w}")
    ps, trainer = FakeParameterServers(replicas), FakeTrainer()
    control, live, phases = FakeControl(set(range(instances))), FakeLive(), []
    supervised = Supervised(
        rollout=rollout,
        rewards=rewards,
        ps=ps,
        trainer=trainer,
        control=control,
        ts=ledger,
        live=live,
        phase=phases.append,
        resume_hint=lambda: "resume with `staleflow launch --resume RUN`",
    )
    supervisor = Supervisor(
        supervised,
        RecoveryConfig(max_restarts=max_restarts),
        clock=clock,
        executor=InlineExecutor(),
    )
    return Harness(supervisor, clock, rollout, rewards, ledger, ps, trainer, control, live, phases)
