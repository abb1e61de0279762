"""A deterministic, in-process :class:`~coordinator.interface.CommandExecutor`.

Commands become operations on *lanes*, one lane per data plane endpoint: ``("engine",
inst)`` per instance, ``("pull", inst)`` per instance (PS reads are shared, so Pulls of
different instances never wait for each other), ``("ts", inst)`` for the TS's hand-outs
to each instance (a Route waiting for an Interrupt holds up no other instance). Nothing
happens on :meth:`InProcessExecutor.issue`; each :meth:`tick` completes every operation
whose dependencies had completed before the tick began, which models the concurrency of
§5.2 / Figure 12(b) one round at a time. Lanes can be blocked to model a slow plane.

Dependencies:
- operations on one lane complete in issue order;
- a Pull runs after the earlier operations on its instance (the Interrupt of its sync);
- a Route first takes its trajectories from the TS (after any pending Interrupt that
  returns one of them) and Reserves initial ones, then delivers them to the instance,
  held until an earlier Pull of that instance has finished.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coordinator.commands import Abort, Command, CommandDone, Interrupt, Pull, Route
from coordinator.interface import EnginePlane, ParameterPlane, TrajectoryPlane
from staleness.errors import StalenessError
from staleness.interface import AdmissionControl
from staleness.types import TrajId

Lane = tuple[str, int | None]


@dataclass(slots=True)
class _Op:
    op_id: int
    lane: Lane
    deps: set[int]
    action: Callable[[], None]
    command: Command


@dataclass(slots=True)
class _Progress:
    missed: list[TrajId] = field(default_factory=list)
    loaded_version: int | None = None
    payloads: dict[TrajId, object] = field(default_factory=dict)


class InProcessExecutor:
    """Carries commands out over in-process data planes, one :meth:`tick` at a time."""

    def __init__(
        self,
        engine: EnginePlane,
        trajectories: TrajectoryPlane,
        parameters: ParameterPlane,
        staleness: AdmissionControl,
        run_round: Callable[[Sequence[Callable[[], None]]], None] | None = None,
    ) -> None:
        self._engine, self._ts, self._ps, self._staleness = (
            engine,
            trajectories,
            parameters,
            staleness,
        )
        self._ops: list[_Op] = []
        self._pending: set[int] = set()  # ids of self._ops
        self._next_id = 0
        self._last_on_lane: dict[Lane, int] = {}
        self._returning: dict[TrajId, int] = {}  # traj -> pending Interrupt op
        self._pulling: dict[int, int] = {}  # inst -> pending Pull op
        self._reports: list[CommandDone] = []
        # commands issued so far, by instance and kind ("pull", "route", ...), for an
        # operator's view; republished as a fresh copy after each issue() so that another
        # thread can read ``issued`` while commands keep coming
        self._issued: dict[int, Counter[str]] = {}
        self.issued: dict[int, dict[str, int]] = {}
        self._blocked: set[Lane] = set()
        # How one round of mutually independent operations runs: in turn by default; a
        # real deployment passes a thread pool's map so Pulls and Routes overlap.
        self._run_round = run_round or _in_turn
        self.ticks = 0

    # -- CommandExecutor -------------------------------------------------------------------

    def issue(self, commands: Sequence[Command]) -> None:
        for command in commands:
            self._issued.setdefault(command.inst, Counter())[type(command).__name__.lower()] += 1
            progress = _Progress()
            match command:
                case Interrupt(inst=inst, trajs=trajs):
                    op = self._add(("engine", inst), command, self._interrupt(command, progress))
                    for t in trajs:
                        self._returning[t] = op
                case Abort(inst=inst):
                    self._add(("engine", inst), command, self._abort(command, progress))
                case Pull(inst=inst):
                    before = self._last_on_lane.get(("engine", inst))
                    deps = set() if before is None else {before}
                    op = self._add(("pull", inst), command, self._pull(command, progress), deps)
                    self._pulling[inst] = op
                case Route(inst=inst, trajs=trajs):
                    deps = {self._returning[t] for t in trajs if t in self._returning}
                    take = self._add(("ts", inst), command, self._take(command, progress), deps)
                    deps = {take} | ({self._pulling[inst]} if inst in self._pulling else set())
                    self._add(("engine", inst), command, self._deliver(command, progress), deps)
        if commands:
            self.issued = {inst: dict(kinds) for inst, kinds in self._issued.items()}

    def poll(self) -> list[CommandDone]:
        out, self._reports = self._reports, []
        return out

    # -- driving it --------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Operations not yet completed."""
        return len(self._ops)

    def pending_by_instance(self) -> dict[int, int]:
        """Commands not yet completed, by the instance they act on. Safe to call from
        another thread while :meth:`tick` runs (it reads one list object)."""
        by_inst: dict[int, set[int]] = {}
        for op in self._ops:
            by_inst.setdefault(op.command.inst, set()).add(id(op.command))
        return {inst: len(cmds) for inst, cmds in by_inst.items()}

    def block(self, lane: Lane) -> None:
        """Hold every operation on ``lane`` (e.g. ``("pull", 3)``) until :meth:`unblock`."""
        self._blocked.add(lane)

    def unblock(self, lane: Lane) -> None:
        self._blocked.discard(lane)

    def tick(self) -> int:
        """Complete every operation whose dependencies were done before this tick."""
        ready = [op for op in self._ops if not op.deps and op.lane not in self._blocked]
        self._run_round([op.action for op in ready])
        finished = {op.op_id for op in ready}
        self._ops = [op for op in self._ops if op.op_id not in finished]
        self._pending -= finished
        for op in self._ops:
            op.deps -= finished
        self._returning = {t: o for t, o in self._returning.items() if o not in finished}
        self._pulling = {i: o for i, o in self._pulling.items() if o not in finished}
        self.ticks += 1
        return len(ready)

    def run_until_idle(self, max_ticks: int = 1000) -> None:
        for _ in range(max_ticks):
            if not self._ops or self.tick() == 0:
                return

    # -- internals -------------------------------------------------------------------------

    def _add(
        self,
        lane: Lane,
        command: Command,
        action: Callable[[], None],
        deps: set[int] | None = None,
    ) -> int:
        op_id = self._next_id
        self._next_id += 1
        deps = set(deps or ())
        previous = self._last_on_lane.get(lane)
        if previous is not None:
            deps.add(previous)
        deps &= self._pending
        self._ops.append(_Op(op_id, lane, deps, action, command))
        self._pending.add(op_id)
        self._last_on_lane[lane] = op_id
        return op_id

    def _report(self, command: Command, progress: _Progress) -> None:
        self._reports.append(CommandDone(command, tuple(progress.missed), progress.loaded_version))

    def _interrupt(self, command: Interrupt, progress: _Progress) -> Callable[[], None]:
        def run() -> None:
            partials = self._engine.interrupt(command.inst, command.trajs)
            self._ts.give_back(partials)
            progress.missed = [t for t in command.trajs if t not in partials]
            self._report(command, progress)

        return run

    def _abort(self, command: Abort, progress: _Progress) -> Callable[[], None]:
        def run() -> None:
            aborted = set(self._engine.abort(command.inst, command.trajs))
            progress.missed = [t for t in command.trajs if t not in aborted]
            self._report(command, progress)

        return run

    def _pull(self, command: Pull, progress: _Progress) -> Callable[[], None]:
        def run() -> None:
            progress.loaded_version = self._ps.pull(command.inst, command.version)
            self._report(command, progress)

        return run

    def _take(self, command: Route, progress: _Progress) -> Callable[[], None]:
        def run() -> None:
            taken = dict(self._ts.take(command.trajs))
            refused: dict[TrajId, object] = {}
            for r in command.reservations:
                if r.traj_id not in taken:
                    continue
                try:
                    self._staleness.reserve(r.group_id, r.traj_id, r.v_traj)
                except StalenessError:
                    refused[r.traj_id] = taken.pop(r.traj_id)
            if refused:
                self._ts.give_back(refused)
            progress.missed = [t for t in command.trajs if t not in taken]
            progress.payloads = taken

        return run

    def _deliver(self, command: Route, progress: _Progress) -> Callable[[], None]:
        def run() -> None:
            if progress.payloads:
                assigned = {
                    r.traj_id: r.v_traj
                    for r in command.reservations
                    if r.traj_id in progress.payloads
                }
                failed = self._engine.submit(command.inst, progress.payloads, assigned)
                if failed:
                    progress.missed.extend(failed)
            self._report(command, progress)

        return run


def _in_turn(actions: Sequence[Callable[[], None]]) -> None:
    for action in actions:
        action()
