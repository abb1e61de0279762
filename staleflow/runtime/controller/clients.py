"""The control actor's clients, one per audience: every call to the
:class:`~staleflow.runtime.controller.actor.ControlActor` goes through one of them.

==========================  ===========================================  ===================
client                      audience                                     runs in
==========================  ===========================================  ===================
:class:`DriverControl`      the run: attach, placement, step records,    the driver
                            checkpoint cuts, stop, evaluation rounds
:class:`SupervisorControl`  the supervisor: lost instances, joins,       the driver
                            removals, replays, scale requests, notes
:class:`ScalingControl`     ``staleflow scale`` and the dashboard:       any process on the
                            members, scale requests, the live state,     cluster
                            records, recovery events, placement
``WorkerControl``           the trainer and the reward workers           the worker actors
                            (:class:`~staleflow.runtime.interface.ControlHandle`;
                            :mod:`staleflow.runtime.workers.control_client`, which the
                            workers may import and this package may not be)
==========================  ===========================================  ===================

These run outside the control actor; they sit in this package because they speak its
methods and records. Each wraps the actor's Ray handle once. A plain method waits for the
answer (``timeout_s`` as ``ray.get`` takes it); ``submit_*`` sends the request and
returns a :class:`Reply` the caller polls between its other looks at the run;
``post_*`` sends it and nobody waits (the caller does not need it done before it goes
on, today's behaviour). ``tests/staleflow/runtime/controller/test_control_clients.py``
fails on a ``.remote()`` to the control actor anywhere else in the library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from staleflow.runtime.placement.ray_cluster import RayApi, import_ray

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from parameter_server.transport.base import Endpoint
    from staleflow.recovery.events import RecoveryEvent
    from staleflow.rewards.estimators import EvalScores
    from staleflow.runfolder.step_record import StepRecord
    from staleflow.runtime.controller.actor import ControlActor
    from staleflow.runtime.controller.fleet import LostInstance
    from staleflow.runtime.controller.plane_records import Cut, LiveState
    from staleflow.runtime.workers.actors import RolloutActor

    RolloutHandle = ActorHandle[RolloutActor]

T = TypeVar("T")


class Reply(Generic[T]):
    """A request to the control actor on its way: :meth:`done` says whether its answer
    is there without waiting, :meth:`result` reads it (raising what the actor raised)."""

    __slots__ = ("_ray", "ref")

    def __init__(self, ray: RayApi, ref: ObjectRef[T]) -> None:
        self._ray = ray
        self.ref = ref  # for a ray.wait over several

    def done(self) -> bool:
        ready, _ = self._ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self, timeout_s: float | None = None) -> T:
        return self._ray.get(self.ref, timeout=timeout_s)


class _ControlClient:
    """The actor's handle and the reads every audience shares."""

    def __init__(self, handle: ActorHandle[ControlActor], ray: RayApi | None = None) -> None:
        self.handle = handle  # the Ray handle, for the actors that make their own client
        self._ray: RayApi = ray if ray is not None else import_ray()

    def live(self, timeout_s: float | None = None) -> LiveState:
        return self._ray.get(self.handle.live.remote(), timeout=timeout_s)

    def records(self, since: int = 0, timeout_s: float | None = None) -> list[StepRecord]:
        """The step records from the ``since``-th on."""
        return self._ray.get(self.handle.records.remote(since), timeout=timeout_s)

    def events(self, since: int = 0, timeout_s: float | None = None) -> list[RecoveryEvent]:
        """The recovery events from the ``since``-th on."""
        return self._ray.get(self.handle.events.remote(since), timeout=timeout_s)

    def members(self, timeout_s: float | None = None) -> dict[int, tuple[str, RolloutHandle]]:
        """The rollout instances in the run now: holder id and actor handle each."""
        return self._ray.get(self.handle.members.remote(), timeout=timeout_s)


class SupervisorControl(_ControlClient):
    """The control plane as the supervisor reaches it: the instances it lost, joins and
    removals (the requests whose answers it polls are ``submit_*``), completions to
    replay, ``staleflow scale``'s requests, and the recovery log."""

    def take_lost(self) -> list[LostInstance]:
        """The instances lost since the last call (each once)."""
        return self._ray.get(self.handle.take_lost.remote())

    def submit_join(
        self, inst: int, actor: RolloutHandle, holder: str, version: int, kind: str
    ) -> Reply[None]:
        """A started instance (``actor``, at weights ``version``) joins the run under
        ``holder``; ``kind``: instance_restarted | instance_added (its recovery event)."""
        return Reply(self._ray, self.handle.join.remote(inst, actor, holder, version, kind))

    def submit_replay_completions(self) -> Reply[int]:
        """Apply the completions a lost reward worker stored in the TS but never
        reported; the answer is how many."""
        return Reply(self._ray, self.handle.replay_completions.remote())

    def remove(self, inst: int) -> int:
        """Take ``inst`` out of the run (interrupted first); returns how many
        trajectories went back to the TS."""
        return self._ray.get(self.handle.remove.remote(inst))

    def take_scale(self) -> int | None:
        """The instances ``staleflow scale`` asked for since the last call (None: no ask)."""
        return self._ray.get(self.handle.take_scale.remote())

    def note(self, kind: str, subject: str, detail: str = "", **amounts: float) -> None:
        """A recovery event (``amounts`` add to the ``recovery/*`` totals)."""
        self._ray.get(self.handle.note.remote(kind, subject, detail, **amounts))


class DriverControl(_ControlClient):
    """The control plane as the run reaches it (``staleflow.runtime.driver.run``, the
    evaluation rounds): it starts the loop, streams the records, writes the checkpoint
    cuts it takes, and stops and settles it at the end."""

    def attach(
        self,
        instances: Mapping[int, tuple[RolloutHandle, str]],
        ps_endpoints: Mapping[str, Endpoint],
        versions: Mapping[int, int] | None = None,
        staleness: Mapping[str, object] | None = None,
        records: Sequence[Mapping[str, float]] = (),
    ) -> None:
        """Start the loop over the instances (actor handle and holder id each); a resumed
        run passes the restored manager's ``staleness`` state, the instances' ``versions``
        and the metric ``records`` so far (``ControlActor.attach``)."""
        self._ray.get(
            self.handle.attach.remote(
                dict(instances),
                dict(ps_endpoints),
                None if versions is None else dict(versions),
                None if staleness is None else dict(staleness),
                list(records),
            )
        )

    def set_placement(self, placement: Mapping[str, object]) -> None:
        """Where the run's actors are and how weights travel (for status and the
        dashboard)."""
        self._ray.get(self.handle.set_placement.remote(dict(placement)))

    def post_note(self, kind: str, subject: str, detail: str = "", **amounts: float) -> None:
        """A recovery event, not waited for."""
        self.handle.note.remote(kind, subject, detail, **amounts)

    def pending_cut(self) -> Cut | None:
        """The checkpoint cut waiting to be written, if any."""
        return self._ray.get(self.handle.pending_cut.remote())

    def post_release_cut(self, steps: int) -> None:
        """The cut of ``steps`` is written: training goes on (not waited for)."""
        self.handle.release_cut.remote(steps)

    def request_stop(self) -> None:
        """Stop routing and take the final cut (Ctrl-C, or the end of the run)."""
        self._ray.get(self.handle.request_stop.remote())

    def eval_due(self) -> int | None:
        """The step whose record waits for its held-out evaluation (None: none)."""
        return self._ray.get(self.handle.eval_due.remote())

    def eval_done(self, step: int, scores: EvalScores | None) -> None:
        """The evaluation of ``step`` (None: given up); its record goes out."""
        self._ray.get(self.handle.eval_done.remote(step, scores))

    def stop(self, timeout_s: float | None = None) -> None:
        self._ray.get(self.handle.stop.remote(), timeout=timeout_s)

    def settle(self) -> dict[int, RolloutHandle]:
        """After :meth:`stop`: the members left once every one is interrupted and the
        gone ones are out of the run."""
        return self._ray.get(self.handle.settle.remote())

    def lost(self, inst: int, reason: str) -> None:
        """``inst`` cannot serve: the plane gives back what it held."""
        self._ray.get(self.handle.lost.remote(inst, reason))


class ScalingControl(_ControlClient):
    """The control plane as ``staleflow scale`` and the dashboard reach it, from any
    process on the cluster (the actor found by its Ray name)."""

    def request_scale(self, instances: int, timeout_s: float | None = None) -> str:
        """Ask for ``instances`` rollout instances; the run's answer, in words."""
        return str(self._ray.get(self.handle.request_scale.remote(instances), timeout=timeout_s))

    def placement(self, timeout_s: float | None = None) -> dict[str, object]:
        """Where the run's actors are and how weights travel (empty before it is set)."""
        return self._ray.get(self.handle.placement.remote(), timeout=timeout_s)

    def submit_live(self) -> Reply[LiveState]:
        return Reply(self._ray, self.handle.live.remote())

    def submit_records(self, since: int = 0) -> Reply[list[StepRecord]]:
        return Reply(self._ray, self.handle.records.remote(since))

    def staleness(self, timeout_s: float | None = None) -> dict[int, int]:
        """Trajectories consumed so far, by staleness."""
        return self._ray.get(self.handle.staleness.remote(), timeout=timeout_s)

    def manager_state(self, timeout_s: float | None = None) -> dict[str, object]:
        """The staleness manager's state now (what a checkpoint writes)."""
        return self._ray.get(self.handle.manager_state.remote(), timeout=timeout_s)
