"""The speculative state P of §5.2: what every instance should look like once all issued
commands have taken effect (Table 1), and snapshot validation against it (Eq. 1)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.commands import Abort, Command, CommandDone, Interrupt, Pull, Route
from coordinator.types import InstanceId, Snapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Why a snapshot was discarded, for one instance (``None`` = instance unknown/absent)."""

    inst: InstanceId
    expected_version: int | None
    seen_version: int | None
    expected_accum: int | None
    seen_accum: int | None


@dataclass(slots=True)
class _Expected:
    version: int
    accum: int
    epoch: int  # Pulls issued so far: a Pull resets what earlier commands did


class SpeculativeState:
    """P of §5.2, plus the bookkeeping that keeps it exact when commands partly fail.

    Table 1 assumes every command takes full effect. In a live system an Interrupt can
    arrive after its trajectory completed, a Route can find its trajectory aborted, a
    Pull can load a newer version than the one decided on; left alone, P would then never
    match again and the coordinator would stall. Executors report such shortfalls in
    :class:`CommandDone`, and :meth:`settle` applies them unless a later Pull of the same
    instance has already reset the expectation.
    """

    def __init__(self, instances: Mapping[InstanceId, int] | Iterable[InstanceId] = ()) -> None:
        versions = instances if isinstance(instances, Mapping) else dict.fromkeys(instances, 0)
        self._p: dict[InstanceId, _Expected] = {
            inst: _Expected(version, 0, 0) for inst, version in versions.items()
        }
        # id(command) -> (command, epoch at issue); the command is kept so its id stays unique.
        self._in_flight: dict[int, tuple[Command, int]] = {}

    def add_instance(self, inst: InstanceId, version: int = 0) -> None:
        """Start tracking a (new, empty) instance."""
        if inst in self._p:
            raise ValueError(f"instance {inst} is already tracked")
        self._p[inst] = _Expected(version, 0, 0)

    def remove_instance(self, inst: InstanceId) -> None:
        """Stop tracking an instance that left (lost, or removed from the fleet). Commands
        still in flight to it are forgotten: their completions settle nothing."""
        if self._p.pop(inst, None) is None:
            raise ValueError(f"instance {inst} is not tracked")
        self._in_flight = {k: v for k, v in self._in_flight.items() if v[0].inst != inst}

    @property
    def instances(self) -> tuple[InstanceId, ...]:
        """The tracked instances, in the order they joined."""
        return tuple(self._p)

    def expected(self, inst: InstanceId) -> tuple[int, int]:
        """``(inst_version, accum_traj_num)`` expected for ``inst``."""
        e = self._p[inst]
        return e.version, e.accum

    @property
    def in_flight(self) -> int:
        """Commands issued whose :class:`CommandDone` has not arrived yet."""
        return len(self._in_flight)

    def apply(self, command: Command) -> None:
        """Table 1: the expected effect of ``command``, recorded at issue time."""
        e = self._p[command.inst]
        match command:
            case Pull(version=version):
                e.version = version
                e.accum = 0
                e.epoch += 1
            case Route(trajs=trajs):
                e.accum += len(trajs)
            case Interrupt(trajs=trajs) | Abort(trajs=trajs):
                e.accum -= len(trajs)
        self._in_flight[id(command)] = (command, e.epoch)

    def settle(self, done: CommandDone) -> None:
        """Account for what ``done.command`` actually did."""
        entry = self._in_flight.pop(id(done.command), None)
        if entry is None or entry[0] is not done.command:
            logger.debug("completion of a command this state never issued: %s", done.command)
            return
        e = self._p[done.command.inst]
        if entry[1] != e.epoch:
            return  # a later Pull cleared the instance: its count no longer involves this
        match done.command:
            case Pull() if done.loaded_version is not None:
                e.version = done.loaded_version
            case Route():
                e.accum -= len(done.missed)
            case Interrupt() | Abort():
                e.accum += len(done.missed)  # they stayed counted (completed meanwhile)

    def mismatches(self, snapshot: Snapshot) -> list[Mismatch]:
        """Every instance that violates Eq. 1 (empty list = the snapshot is valid)."""
        out: list[Mismatch] = []
        seen: set[InstanceId] = set()
        for s in snapshot.instances:
            seen.add(s.inst)
            e = self._p.get(s.inst)
            accum = s.accum_traj_num
            if e is None:
                out.append(Mismatch(s.inst, None, s.inst_version, None, accum))
            elif e.version != s.inst_version or e.accum != accum:
                out.append(Mismatch(s.inst, e.version, s.inst_version, e.accum, accum))
        for inst, e in self._p.items():
            if inst not in seen:
                out.append(Mismatch(inst, e.version, None, e.accum, None))
        return out

    def validate(self, snapshot: Snapshot) -> bool:
        """Eq. 1 for every instance, and the snapshot covers exactly the tracked instances."""
        p = self._p
        if len(snapshot.instances) != len(p):
            return False
        if len({s.inst for s in snapshot.instances}) != len(p):
            return False  # an instance listed twice hides a missing one
        for s in snapshot.instances:
            e = p.get(s.inst)
            if (
                e is None
                or e.version != s.inst_version
                or e.accum != len(s.run_trajs) + len(s.wait_trajs) + len(s.complete_trajs)
            ):
                return False
        return True
