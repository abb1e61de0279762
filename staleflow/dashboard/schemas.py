"""The dashboard's response models (what FastAPI's OpenAPI page documents) and their
construction from the source's plain data. Values a source does not know are ``null``;
``notes`` say why."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from coordinator.cost_model import CostModel
from staleflow.dashboard.interface import (
    InstanceDetail,
    LiveView,
    LoadSample,
    Page,
    PSView,
    RunEvent,
    RunInfo,
)
from staleflow.runfolder.step_record import ELAPSED, STEP, VERSION, StepRecord
from trajectory_server.types import TSStats


class ErrorOut(BaseModel):
    detail: str = Field(description="what was wrong and how to fix the request")


class CostModelOut(BaseModel):
    """Eq. 2's cost model: step latency ``k1*kv + max(k2, k3*n) + k4`` seconds."""

    k1: float
    k2: float
    k3: float
    k4: float
    k5: float
    kv_budget: float

    @classmethod
    def of(cls, model: CostModel | None) -> CostModelOut | None:
        if model is None:
            return None
        return cls(
            k1=model.k1,
            k2=model.k2,
            k3=model.k3,
            k4=model.k4,
            k5=model.k5,
            kv_budget=model.kv_budget,
        )


class RunOut(BaseModel):
    kind: Literal["live", "folder", "sim"]
    name: str
    clock: Literal["wall", "virtual"] = Field(description="what the run's seconds measure")
    eta: int | None
    batch_size: int | None
    group_size: int | None
    instances: int | None
    finished: bool
    steps: int = Field(description="training steps finished")
    elapsed_s: float
    trainer_version: int | None = Field(description="the next buffer the trainer consumes")
    ps_version: int | None
    cycles: int | None = Field(description="coordinator snapshot cycles")
    discarded: int | None = Field(description="snapshots rejected by Eq. 1")
    pending_commands: int | None
    actions: list[str] = Field(description="POST /api/actions/{action} (needs the token)")
    phase: str | None = Field(
        None, description="what the launcher is doing now, when it tells the dashboard"
    )
    state: str | None = Field(
        None,
        description="a run folder's state (state.json): finished, running, stopped "
        "(resumable), crashed or unknown (another machine's, or a folder written before "
        "state.json); null for a live or simulated run, where `finished` says it",
    )
    notes: list[str]
    placement: dict[str, Any] = Field(
        default_factory=dict,
        description="live runs: the nodes, the node of every actor, the PS replicas, each "
        "instance's Pull route and the Push plan with its transports",
    )


class EntryOut(BaseModel):
    group_id: int
    version: int = Field(description="the group's version: min V_traj of its members")
    kind: Literal["reserved", "occupied"]


class BufferOut(BaseModel):
    version: int = Field(description="V_buf")
    state: Literal["waiting", "ready", "stuck"]
    capacity: int = Field(description="entry slots")
    occupied: int
    reserved: int
    entries: list[EntryOut]


class BuffersOut(BaseModel):
    available: bool
    trainer_version: int | None
    eta: int | None
    batch_size: int | None
    group_size: int | None
    reserved_groups: int | None
    occupied_groups: int | None
    consumed_batches: int | None
    aborted_groups: int | None
    buffers: list[BufferOut]
    notes: list[str]


class TrajOut(BaseModel):
    traj_id: int
    group_id: int
    v_traj: int | None
    length: int = Field(description="prompt + generated tokens")
    prompt_len: int


class InstanceOut(BaseModel):
    inst: int
    model_version: int | None
    kv_cache_tokens: int | None
    kv_budget_tokens: float | None = Field(description="M of the cost model")
    running: int | None
    waiting: int | None
    completed: int | None = Field(description="finished here since the last Pull")
    accum_traj_num: int | None = Field(description="|run + wait + complete| of Eq. 1")
    run_trajs: list[TrajOut] | None = Field(None, description="with ?trajectories=true")
    wait_trajs: list[TrajOut] | None = Field(None, description="with ?trajectories=true")
    complete_trajs: list[int] | None = Field(None, description="with ?trajectories=true")
    throughput_estimate_tokens_per_s: float | None = Field(
        description="the cost model's T(n, kv) for this snapshot (Eq. 2)"
    )
    measured_tokens_per_s: float | None = Field(description="decoded since the last sample")
    idle_ratio: float | None
    pending_commands: int | None
    last_cycle_commands: dict[str, int] | None = Field(
        description="commands of the latest coordinator cycle, by kind"
    )
    commands_total: dict[str, int] | None = Field(
        description="commands sent to this instance since the run started, by kind"
    )


class InstancesOut(BaseModel):
    instances: list[InstanceOut]
    cost_model: CostModelOut | None
    notes: list[str]


class TSOut(BaseModel):
    available: bool
    capacity_groups: int | None = None
    groups: int | None = None
    by_state: dict[str, int] = Field(
        default_factory=dict, description="queued, routed, completed; initial = no V_traj yet"
    )
    by_v_traj: dict[str, dict[int, int]] = Field(
        default_factory=dict, description="state -> V_traj -> trajectories"
    )
    totals: dict[str, int] = Field(default_factory=dict)
    dataset_exhausted: bool | None = None
    notes: list[str] = Field(default_factory=list)


class PSOut(BaseModel):
    latest: int | None
    held: list[int] | None
    num_slots: int | None
    readers: list[int] | None
    pushing: bool | None
    last_push_s: float | None
    last_pull_s: dict[int, float] = Field(description="instance -> run time of its last Pull")
    version_bytes: int | None
    notes: list[str]


class PageOut(BaseModel):
    start: int
    next: int = Field(description="pass as ?since= to get what came after")
    total: int
    first: int = Field(description="older items were dropped to bound memory")


class RecordsOut(PageOut):
    records: list[dict[str, float | None]]


class StalenessRow(BaseModel):
    step: int
    version: int = Field(description="V_buf of the consumed buffer")
    hist: dict[int, int] = Field(description="V_buf - V_traj -> trajectories")
    mean: float | None
    max: int | None


class StalenessOut(PageOut):
    buffers: list[StalenessRow]


class LoadSampleOut(BaseModel):
    time: float
    inst: int
    version: int | None
    running: int | None
    waiting: int | None
    kv_tokens: int | None
    tokens_per_s: float | None
    busy_ratio: float | None


class LoadOut(PageOut):
    samples: list[LoadSampleOut]


class EventOut(BaseModel):
    time: float
    kind: Literal["pull", "push", "step", "recovery"]
    version: int  # a recovery: the training steps done by then
    inst: int | None
    detail: str = ""  # a recovery: what happened


class EventsOut(PageOut):
    events: list[EventOut]


class OverviewOut(BaseModel):
    """Everything the page redraws every second, in one consistent read."""

    run: RunOut
    buffers: BuffersOut
    instances: InstancesOut
    ts: TSOut
    ps: PSOut


class ActionOut(BaseModel):
    action: str
    result: str


# -- construction ------------------------------------------------------------------------


def run_out(info: RunInfo, live: LiveView) -> RunOut:
    view = live.buffers
    return RunOut(
        kind=info.kind,
        name=info.name,
        clock=info.clock,
        eta=info.eta,
        batch_size=info.batch_size,
        group_size=info.group_size,
        instances=info.instances,
        finished=live.finished,
        steps=live.steps,
        elapsed_s=_finite(live.elapsed_s) or 0.0,
        trainer_version=view.version if view is not None else None,
        ps_version=live.ps_version,
        cycles=live.cycles,
        discarded=live.discarded,
        pending_commands=live.pending_commands,
        actions=list(info.actions),
        phase=live.phase,
        state=live.state,
        notes=[*info.notes, *live.notes],
        placement=dict(info.placement),
    )


def buffers_out(live: LiveView) -> BuffersOut:
    view = live.buffers
    if view is None:
        return BuffersOut(
            available=False,
            trainer_version=None,
            eta=None,
            batch_size=None,
            group_size=None,
            reserved_groups=None,
            occupied_groups=None,
            consumed_batches=None,
            aborted_groups=None,
            buffers=[],
            notes=["no live staleness manager: the run is not attached live"],
        )
    return BuffersOut(
        available=True,
        trainer_version=view.version,
        eta=view.eta,
        batch_size=view.batch_size,
        group_size=view.group_size,
        reserved_groups=view.reserved_groups,
        occupied_groups=view.occupied_groups,
        consumed_batches=view.consumed_batches,
        aborted_groups=view.aborted_groups,
        buffers=[
            BufferOut(
                version=b.version,
                state=b.state.value,
                capacity=b.capacity,
                occupied=b.occupied,
                reserved=b.reserved,
                entries=[
                    EntryOut(group_id=e.group_id, version=e.version, kind=e.kind.value)
                    for e in b.entries
                ],
            )
            for b in view.buffers
        ],
        notes=[],
    )


def instance_out(d: InstanceDetail, cost: CostModel | None, trajectories: bool) -> InstanceOut:
    s = d.snapshot
    estimate = None
    if s is not None and cost is not None:
        estimate = cost.throughput(len(s.run_trajs), s.kv_cache)
    return InstanceOut(
        inst=d.inst,
        model_version=s.inst_version if s is not None else d.version,
        kv_cache_tokens=s.kv_cache if s is not None else None,
        kv_budget_tokens=cost.kv_budget if cost is not None else None,
        running=len(s.run_trajs) if s is not None else None,
        waiting=len(s.wait_trajs) if s is not None else None,
        completed=len(s.complete_trajs) if s is not None else None,
        accum_traj_num=s.accum_traj_num if s is not None else None,
        run_trajs=_trajs(s.run_trajs) if s is not None and trajectories else None,
        wait_trajs=_trajs(s.wait_trajs) if s is not None and trajectories else None,
        complete_trajs=list(s.complete_trajs) if s is not None and trajectories else None,
        throughput_estimate_tokens_per_s=_finite(estimate),
        measured_tokens_per_s=_finite(d.measured_tokens_per_s),
        idle_ratio=_finite(d.idle_ratio),
        pending_commands=d.pending_commands,
        last_cycle_commands=_counts(d.last_cycle_commands),
        commands_total=_counts(d.commands_total),
    )


def instances_out(info: RunInfo, live: LiveView, trajectories: bool = False) -> InstancesOut:
    notes = []
    if info.cost_model is None:
        notes.append("cost model unknown: no throughput estimates")
    if any(d.snapshot is None for d in live.instances):
        notes.append("no snapshot for some instances (not attached live, or no cycle yet)")
    return InstancesOut(
        instances=[instance_out(d, info.cost_model, trajectories) for d in live.instances],
        cost_model=CostModelOut.of(info.cost_model),
        notes=notes,
    )


def ts_out(stats: TSStats | None) -> TSOut:
    if stats is None:
        return TSOut(available=False, notes=["the trajectory server is not attached live"])
    return TSOut(
        available=True,
        capacity_groups=stats.capacity_groups,
        groups=stats.groups,
        by_state={
            "queued": stats.queued,
            "routed": stats.routed,
            "completed": stats.completed,
            "initial": stats.initial,
        },
        by_v_traj={
            "queued": dict(stats.queued_by_v),
            "routed": dict(stats.routed_by_v),
            "completed": dict(stats.completed_by_v),
        },
        totals={
            "created_trajectories": stats.created_trajectories,
            "consumed_trajectories": stats.consumed_trajectories,
            "aborted_trajectories": stats.aborted_trajectories,
            "created_groups": stats.created_groups,
            "consumed_groups": stats.consumed_groups,
            "aborted_groups": stats.aborted_groups,
        },
        dataset_exhausted=stats.dataset_exhausted,
    )


def ps_out(ps: PSView) -> PSOut:
    return PSOut(
        latest=ps.latest,
        held=list(ps.held) if ps.held is not None else None,
        num_slots=ps.num_slots,
        readers=list(ps.readers) if ps.readers is not None else None,
        pushing=ps.pushing,
        last_push_s=_finite(ps.last_push_s),
        last_pull_s={int(k): v for k, v in ps.last_pull_s.items()},
        version_bytes=ps.version_bytes,
        notes=list(ps.notes),
    )


def _page(page: Page[Any]) -> dict[str, int]:
    return {"start": page.start, "next": page.next, "total": page.total, "first": page.first}


def records_out(page: Page[StepRecord], prefix: str = "") -> RecordsOut:
    """The records in their flat form (the ``metrics.jsonl`` keys)."""
    keep = _keep_keys(prefix)
    return RecordsOut(
        **_page(page),
        records=[{k: _finite(v) for k, v in r.to_flat().items() if keep(k)} for r in page.items],
    )


def _keep_keys(prefix: str) -> Any:
    if not prefix:
        return lambda key: True
    # a record without its step number is useless on a chart
    return lambda key: key in (STEP, VERSION, ELAPSED) or key.startswith(prefix)


def staleness_out(page: Page[StepRecord]) -> StalenessOut:
    return StalenessOut(
        **_page(page),
        buffers=[
            StalenessRow(
                step=r.step,
                version=r.version,
                hist=dict(r.staleness),
                mean=_finite(r.staleness_mean),
                max=r.staleness_max,
            )
            for r in page.items
        ],
    )


def load_out(page: Page[LoadSample]) -> LoadOut:
    return LoadOut(
        **_page(page),
        samples=[
            LoadSampleOut(
                time=s.time,
                inst=s.inst,
                version=s.version,
                running=s.running,
                waiting=s.waiting,
                kv_tokens=s.kv_tokens,
                tokens_per_s=_finite(s.tokens_per_s),
                busy_ratio=_finite(s.busy_ratio),
            )
            for s in page.items
        ],
    )


def events_out(page: Page[RunEvent], kinds: Sequence[str] = ()) -> EventsOut:
    return EventsOut(
        **_page(page),
        events=[
            EventOut(time=e.time, kind=e.kind, version=e.version, inst=e.inst, detail=e.detail)
            for e in page.items
            if not kinds or e.kind in kinds
        ],
    )


def _counts(counts: Mapping[str, int] | None) -> dict[str, int] | None:
    return dict(counts) if counts is not None else None


def _trajs(trajs: Sequence[Any]) -> list[TrajOut]:
    return [
        TrajOut(
            traj_id=t.traj_id,
            group_id=t.group_id,
            v_traj=t.v_traj,
            length=t.length,
            prompt_len=t.prompt_len,
        )
        for t in trajs
    ]


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: unknown is null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)
