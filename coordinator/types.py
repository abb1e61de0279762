"""Snapshot data the coordinator decides on (paper §5.2, Figure 11).

Units: ``kv_cache`` is counted in *tokens* held in the instance's KV cache, not bytes.
Table 4's ``k1 = 7.28e-8`` only gives plausible decode latencies for Qwen3-30B-A3B on an
H20 when read as seconds per cached token (per byte it would predict minutes per step),
so the cost model's ``k5`` is "KV tokens per trajectory token" (1.0) and its budget ``M``
is a token count. Every producer of snapshots must report tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from staleness.types import GroupId, TrajId

InstanceId = int


class TrajectoryView(Protocol):
    """What routing needs to know about one trajectory (the TS's routing view).

    ``v_traj`` is None for an initial trajectory (not yet routed); it is set for every
    trajectory that is, or has been, on an instance. ``length`` counts prompt plus
    generated tokens so far.
    """

    @property
    def traj_id(self) -> TrajId: ...

    @property
    def group_id(self) -> GroupId: ...

    @property
    def v_traj(self) -> int | None: ...

    @property
    def length(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TrajRecord:
    """A plain :class:`TrajectoryView`, for engines' snapshots, tests and the simulator."""

    traj_id: TrajId
    group_id: GroupId
    v_traj: int | None
    length: int
    prompt_len: int


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """The five fields of §5.2 for one rollout instance, and what multi-turn work adds.

    ``run_trajs``, ``wait_trajs`` and ``complete_trajs`` are disjoint (a trajectory is in
    at most one of them); ``wait_trajs`` is in the engine's queue order, head first, and
    its members hold no KV cache. ``complete_trajs`` lists what finished on this instance
    since its last Pull, a model turn that ended here included.

    Multi-turn (agentic) work separates **decoding** from **waiting on an environment**:
    ``run_trajs`` and ``kv_cache`` are the decoding work only, the cost model's ``n`` and
    ``kv``. ``env_trajs`` are trajectories whose last model turn ended on this instance
    and which now wait on their environment (a tool call): they hold no decode slot and
    are in no command's way; their ``length`` is the response at the turn's end. ``held``
    lists ``(trajectory, KV tokens)`` of prefixes this instance still caches after a turn
    ended or an interrupt (a prefix cache, evicted when decoding needs the room; dropped
    by a Pull): a next turn routed here reuses them instead of prefilling. Both are empty
    for single-turn work and for engines that report neither; neither counts in Eq. 1.
    ``held_exact``: ``held`` is the engine's own list, evictions included (the embedded
    engine's prefix store, the simulator); False: the engine keeps no such list and a
    real run's control plane fills ``held`` in by assumption
    (``staleflow/runtime/controller/tool_view.py``).
    """

    inst: InstanceId
    kv_cache: int  # tokens
    run_trajs: tuple[TrajectoryView, ...]
    wait_trajs: tuple[TrajectoryView, ...]
    complete_trajs: tuple[TrajId, ...]
    inst_version: int
    env_trajs: tuple[TrajectoryView, ...] = ()
    held: tuple[tuple[TrajId, int], ...] = ()
    held_exact: bool = False

    @property
    def accum_traj_num(self) -> int:
        """|run + wait + complete| of Eq. 1 (the three sets are disjoint)."""
        return len(self.run_trajs) + len(self.wait_trajs) + len(self.complete_trajs)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All instances at one moment; ``taken_at`` is the producer's clock."""

    instances: tuple[InstanceSnapshot, ...]
    taken_at: float = 0.0
