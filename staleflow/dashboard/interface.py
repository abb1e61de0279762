"""The contract between the dashboard's web app and what it watches (no logic here).

A :class:`RunSource` is one run seen read-only: a live Ray job, a run folder, or a
simulated cluster. Sources answer from state they already hold (a poller or the
simulator's observer refreshes it), so a request never waits on the run and a slow or
dead run cannot hang the server. Every field a source cannot know is ``None`` and the
reason goes into a ``notes`` entry: the dashboard says what it does not know instead of
showing a made-up zero.

Times are seconds since the run started, on the run's own clock: wall time for a real
run, virtual time for a simulated one (``RunInfo.clock``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from coordinator.cost_model import CostModel
from coordinator.types import InstanceSnapshot
from staleflow.runfolder.step_record import StepRecord
from staleness.types import ManagerView
from trajectory_server.types import TSStats

T = TypeVar("T")
SourceKind = Literal["live", "folder", "sim"]
EventKind = Literal["pull", "push", "step", "recovery"]


class ActionNotSupported(RuntimeError):
    """The source cannot carry this action out (e.g. pausing a finished run)."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    kind: SourceKind
    name: str
    clock: Literal["wall", "virtual"]
    eta: int | None
    batch_size: int | None
    group_size: int | None
    instances: int | None
    cost_model: CostModel | None  # what the coordinator plans with, for estimates
    config: Mapping[str, Any] = field(default_factory=dict)  # resolved run config, if known
    actions: tuple[str, ...] = ()  # what :meth:`RunSource.act` accepts
    notes: tuple[str, ...] = ()
    # live runs: nodes, where each actor runs, PS replicas, Pull routes and the Push plan
    # (staleflow.runtime.placement.fitting.Placement.as_dict plus "weights")
    placement: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InstanceDetail:
    """One rollout instance. ``snapshot`` is None where only per-step records exist
    (a run folder): then ``version`` and ``idle_ratio`` come from the last record."""

    inst: int
    version: int | None
    snapshot: InstanceSnapshot | None
    measured_tokens_per_s: float | None  # decoded tokens per second since the last sample
    idle_ratio: float | None  # share of the run so far with nothing to decode
    pending_commands: int | None  # issued to the executor and not yet carried out
    last_cycle_commands: Mapping[str, int] | None  # by kind: pull, route, interrupt, abort
    commands_total: Mapping[str, int] | None = None  # by kind, since the run started


@dataclass(frozen=True, slots=True)
class LiveView:
    """The run now. ``buffers`` and ``ts`` are None once nobody can ask the run."""

    buffers: ManagerView | None
    instances: tuple[InstanceDetail, ...]
    ts: TSStats | None
    ps_version: int | None
    steps: int
    elapsed_s: float
    finished: bool
    cycles: int | None = None  # coordinator snapshot cycles
    discarded: int | None = None  # snapshots rejected by Eq. 1
    pending_commands: int | None = None
    notes: tuple[str, ...] = ()
    # what the launcher says it is doing ("training 20 steps with eta=3", "saving the
    # checkpoint"...), for a source whose launcher tells it; None otherwise
    phase: str | None = None
    # a run folder's state (staleflow.runfolder.run_state): finished, running, stopped,
    # crashed or unknown; None where ``finished`` says it all (a live or simulated run)
    state: str | None = None


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Figure 17: one instance's load at one time. A run folder has only per-step idle
    ratios, so ``running``/``waiting``/``kv_tokens`` are None there and ``busy_ratio``
    is set."""

    time: float
    inst: int
    version: int | None
    running: int | None
    waiting: int | None
    kv_tokens: int | None
    tokens_per_s: float | None
    busy_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class RunEvent:
    """A marker on the timelines: an instance Pulled ``version`` (``pull``), the PS got
    ``version`` (``push``), or the trainer finished the step that produced ``version``
    (``step``). Pull and push times are when the source first saw the new version. A
    ``recovery`` (docs/recovery.md: a lost or restarted actor, an instance added or
    removed, a checkpoint, a resume) has the steps done by then as ``version`` and says
    what happened in ``detail``."""

    time: float
    kind: EventKind
    version: int
    inst: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PSView:
    latest: int | None
    held: tuple[int, ...] | None
    num_slots: int | None
    readers: tuple[int, ...] | None  # versions being read right now
    pushing: bool | None
    last_push_s: float | None  # run time at which the latest version appeared
    last_pull_s: Mapping[int, float]  # per instance: run time of its latest Pull
    version_bytes: int | None  # size of one version of the weights
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """Items ``start .. next - 1`` of an append-only log; ``total`` items so far. Items
    before ``first`` were dropped to bound memory (``start >= first``)."""

    start: int
    next: int
    total: int
    first: int
    items: tuple[T, ...]


class RunSource(Protocol):
    """What the dashboard needs of a run. All methods are cheap and thread-safe; ``since``
    and ``limit`` are already validated (``since >= 0``, ``limit >= 1``)."""

    def info(self) -> RunInfo: ...

    def live(self) -> LiveView: ...

    def records(self, since: int, limit: int) -> Page[StepRecord]:
        """Per-step records (:class:`~staleflow.runfolder.step_record.StepRecord`)."""
        ...

    def load(self, since: int, limit: int) -> Page[LoadSample]: ...

    def events(self, since: int, limit: int) -> Page[RunEvent]: ...

    def ps(self) -> PSView: ...

    def act(self, action: str) -> str:
        """Carry out one of ``info().actions`` (the app checks the token first); returns
        what happened. Raises :class:`ActionNotSupported` for anything else."""
        ...

    def close(self) -> None: ...
