"""What the supervisor (:mod:`staleflow.runtime.driver.supervisor`) sees of a run: one
narrow typed face per thing it watches or acts on, no Ray and no ``Run``.

- :class:`Pending`: a call in flight (a Ray ref behind the real faces, a future in the
  tests); the supervisor never blocks on one it may have to poll.
- :class:`RolloutFleet`: the rollout instances and their slots, by instance id.
- :class:`RewardWorkers`: the reward workers, by worker id.
- :class:`ParameterServers`: the PS replicas, by role.
- :class:`TrainerFace`: the trainer's refill of restarted replicas.
- :class:`SupervisorControl`: the control actor's supervisor face.
- :class:`RewardLedger`: the trajectory server's REWARDING trajectories.
- :class:`LiveFile`: ``RUN_DIR/live.json``.

Actor handles cross these faces only as opaque values (``Handle``) that the supervisor
passes from one face to another (an instance's handle to the control plane's join, the
reward workers to the instances), never calls. The real faces over a run's Ray pools
are :mod:`staleflow.runtime.driver.supervised_ray`; the unit tests' fakes are
``tests/support/fake_pools.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from staleflow.runtime.controller.fleet import LostInstance
    from staleflow.runtime.controller.plane_records import LiveState
    from trajectory_server.types import RewardTask, TSStats

T_co = TypeVar("T_co", covariant=True)

# an actor handle the supervisor only hands on (to the control plane, to the instances)
Handle = object


class ActorGone(Exception):
    """The actor behind a call died (Ray's ``RayActorError``): what a :class:`Pending`
    raises then, apart from a call that failed inside a live actor."""


class Pending(Protocol[T_co]):
    """A call in flight."""

    def done(self) -> bool:
        """Whether :meth:`result` would return (or raise) at once."""
        ...

    def result(self, timeout_s: float | None = None) -> T_co:
        """The call's answer; raises what it raised (:class:`ActorGone` when its actor
        died, where the face says so), or ``TimeoutError`` when it is not done within
        ``timeout_s``."""
        ...


class RolloutFleet(Protocol):
    """The rollout instances by id; an instance's slot is where its incarnations run."""

    def started(self) -> Collection[int]:
        """Every instance with an actor now, those still starting included."""
        ...

    def handle(self, inst: int) -> Handle:
        """The actor of the newest incarnation of ``inst``."""
        ...

    def holder(self, inst: int) -> str:
        """The TS holder id of the newest incarnation of ``inst``."""
        ...

    def slots(self) -> Collection[int]:
        """The instances that have a slot (their incarnations' placement)."""
        ...

    def add_slot(self, inst: int) -> None:
        """A slot for one more instance; raises ``LaunchError`` naming what is missing
        when there is no room for it."""
        ...

    def spawn(
        self, inst: int, incarnation: int, rewards: Mapping[str, Handle], at_least: int
    ) -> Pending[int]:
        """Start incarnation ``incarnation`` of ``inst`` in its slot (its actor and holder
        id replace the old ones); it Pulls ``at_least`` or newer. Resolves to the version
        it holds once it serves."""
        ...

    def set_rewards(self, inst: int, rewards: Mapping[str, Handle]) -> None:
        """Tell ``inst`` the reward workers alive now (not waited for)."""
        ...

    def stop(self, inst: int, timeout_s: float) -> None:
        """Stop ``inst``'s engine, waited for; raises if it does not."""
        ...

    def kill(self, inst: int) -> None:
        """Kill ``inst``'s actor for good (nothing if it has none or it is gone)."""
        ...

    def release_slots(self) -> None:
        """Give back the placement of the slots added while the run was up."""
        ...


class RewardWorkers(Protocol):
    """The reward workers by worker id (one id per incarnation of a role)."""

    def live(self) -> Mapping[str, Handle]:
        """The workers in the pool now, in the order they were started."""
        ...

    def role_of(self, wid: str) -> str: ...

    def ping(self, wid: str) -> Pending[object]: ...

    def spawn(self, role: str, incarnation: int) -> str:
        """Start incarnation ``incarnation`` of ``role``; returns its worker id."""
        ...

    def remove(self, wid: str) -> None:
        """Kill ``wid`` for good and take it out of the pool."""
        ...

    def score(self, wid: str, tasks: Sequence[RewardTask]) -> Pending[None]:
        """Have ``wid`` score ``tasks``."""
        ...


class ParameterServers(Protocol):
    """The PS replicas by role (``ps/<k>``)."""

    def handles(self) -> Mapping[str, Handle]: ...

    def alive(self, role: str) -> Pending[bool]:
        """True while the replica serves; False when its actor answers but the worker
        process holding its weights exited."""
        ...

    def stop(self, role: str, timeout_s: float) -> None:
        """Have the replica free what its worker left (shared memory), waited for."""
        ...

    def kill(self, role: str) -> None: ...

    def respawn(self, role: str) -> None:
        """Start ``role`` again in its bundle under its Ray name, empty; returns once it
        serves."""
        ...


class TrainerFace(Protocol):
    def handles(self) -> Mapping[str, Handle]:
        """Every rank's actor, by role."""
        ...

    def refill_ps(self) -> None:
        """Push the newest weights to the replicas that were restarted empty."""
        ...


class SupervisorControl(Protocol):
    """The control actor, as the supervisor uses it: what its typed client
    (:class:`staleflow.runtime.controller.clients.SupervisorControl`) offers. A join and a replay go through
    the control loop, which may itself wait for what the supervisor restarts: they are
    submitted, and the supervisor looks at their replies again later."""

    def take_lost(self) -> list[LostInstance]: ...

    def live(self, timeout_s: float | None = None) -> LiveState:
        """The run now; its ``ps_version`` is what a new instance Pulls first."""
        ...

    def submit_join(
        self, inst: int, actor: Handle, holder: str, version: int, kind: str
    ) -> Pending[None]: ...

    def remove(self, inst: int) -> int: ...

    def members(self, timeout_s: float | None = None) -> Mapping[int, object]:
        """The instances in the run now (by id)."""
        ...

    def submit_replay_completions(self) -> Pending[int]: ...

    def take_scale(self) -> int | None: ...

    def note(self, kind: str, subject: str, detail: str = "", **amounts: float) -> None: ...


class RewardLedger(Protocol):
    """The trajectory server, for the trajectories being scored
    (``TrajectoryServerClient`` is one)."""

    def reassign_rewards(
        self, from_worker: str | None, to_worker: str | None
    ) -> Sequence[RewardTask]: ...

    def stats(self) -> TSStats: ...


class LiveFile(Protocol):
    """``RUN_DIR/live.json``: how to reach the run, and every actor's process id."""

    def write(self, actors: Mapping[str, Handle]) -> None: ...

    def remove(self) -> None: ...


@dataclass(frozen=True)
class Supervised:
    """Everything the supervisor acts on, and what it tells the user."""

    rollout: RolloutFleet
    rewards: RewardWorkers
    ps: ParameterServers
    trainer: TrainerFace
    control: SupervisorControl
    ts: RewardLedger
    live: LiveFile
    phase: Callable[[str], None]  # a line for the terminal
    resume_hint: Callable[[], str]  # how to resume, for an error that stops the run
