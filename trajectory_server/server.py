"""The trajectory server core (paper §5.1): every trajectory in flight, as a state machine.

Life of a trajectory::

    refill ─► QUEUED ──route──► ROUTED ──complete──► COMPLETED ──take_batch──► consumed
                 ▲                 │
                 └─interrupt_return┘          abort / abort_group (any state) ─► aborted

Every public method validates its whole input before it changes anything, so a call that
raises leaves the server as it was. Plain class, single-threaded; ``actor.py`` serves it
over Ray.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from trajectory_server import validate
from trajectory_server.errors import (
    InvalidPayload,
    InvalidTransition,
    TrajectoryGone,
    UnknownGroup,
    UnknownTrajectory,
    VersionConflict,
)
from trajectory_server.interface import PromptSource
from trajectory_server.mlq import MultiLevelQueue
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    GroupStatus,
    InfoValue,
    InstanceId,
    PartialTrajectory,
    RoutableTrajectory,
    RoutedTrajectory,
    TrainingBatch,
    TrainingGroup,
    TrainingTrajectory,
    TrajectoryServerConfig,
    TrajState,
    TSStats,
)

logger = logging.getLogger(__name__)

QUEUED, ROUTED, COMPLETED = TrajState.QUEUED, TrajState.ROUTED, TrajState.COMPLETED


def _empty(dtype: type) -> np.ndarray:
    arr = np.empty(0, dtype=dtype)
    arr.flags.writeable = False
    return arr


_NO_TOKENS, _NO_LOGPROBS = _empty(np.int32), _empty(np.float32)


class _Group:
    __slots__ = ("answer", "completed", "group_id", "members", "prompt", "sample_id")

    def __init__(self, group_id: int, sample_id: int, answer: str, prompt: np.ndarray) -> None:
        self.group_id = group_id
        self.sample_id = sample_id
        self.answer = answer
        self.prompt = prompt
        self.members: dict[int, _Traj] = {}
        self.completed = 0


class _Traj:
    __slots__ = (
        "finish_reason",
        "group",
        "info",
        "instance_id",
        "logprobs",
        "reward",
        "state",
        "tokens",
        "traj_id",
        "v_traj",
        "versions",
    )

    def __init__(self, traj_id: int, group: _Group) -> None:
        self.traj_id = traj_id
        self.group = group
        self.state = QUEUED
        self.v_traj: int | None = None
        self.tokens = _NO_TOKENS
        self.logprobs = _NO_LOGPROBS
        self.versions = _NO_TOKENS
        self.instance_id: InstanceId | None = None
        self.reward = 0.0
        self.finish_reason = ""
        self.info: Mapping[str, InfoValue] = {}

    def record(self) -> RoutableTrajectory:
        prompt_len = len(self.group.prompt)
        return RoutableTrajectory(
            self.traj_id,
            self.group.group_id,
            self.v_traj,
            prompt_len + len(self.tokens),
            prompt_len,
        )

    def describe(self) -> str:
        where = f" on instance {self.instance_id!r}" if self.state is ROUTED else ""
        group = self.group.group_id
        return f"trajectory {self.traj_id} (group {group}) is {self.state.name}{where}"


def _unique(ids: Iterable[int], what: str) -> list[int]:
    out = list(ids)
    if len(set(out)) != len(out):
        dup = next(i for i in out if out.count(i) > 1)
        raise InvalidTransition(f"{what} lists id {dup} more than once")
    return out


class TrajectoryServer:
    """Holds initial, partial and completed trajectories; see the module docstring.

    ``source`` supplies prompts; each becomes a group of
    ``config.trajectories_per_group`` initial trajectories. With ``fill`` the server
    samples up to capacity at once.
    """

    def __init__(
        self, config: TrajectoryServerConfig, source: PromptSource, *, fill: bool = True
    ) -> None:
        self._config = config
        self._source = source
        self._capacity = config.capacity
        self._per_group = config.trajectories_per_group
        self._trajs: dict[int, _Traj] = {}
        self._groups: dict[int, _Group] = {}
        self._mlq = MultiLevelQueue()
        # live trajectories per state and V_traj (None: initial), for stats() in O(levels)
        self._counts: dict[TrajState, Counter[int | None]] = {s: Counter() for s in TrajState}
        self._next_traj = 0
        self._next_group = 0
        self._consumed_trajs = self._aborted_trajs = 0
        self._consumed_groups = self._aborted_groups = 0
        self._exhausted = False
        if fill:
            self.refill()

    @property
    def config(self) -> TrajectoryServerConfig:
        return self._config

    # ----------------------------------------------------------------- views

    def routing_view(self) -> Sequence[RoutableTrajectory]:
        """The QUEUED trajectories in MLQ order. O(1) when nothing changed since last call."""
        return self._mlq.view()

    def state_of(self, traj_id: int) -> TrajState:
        return self._lookup(traj_id).state

    def group_members(self, group_id: int) -> tuple[int, ...]:
        """Live trajectory ids of a group, in creation order."""
        return tuple(self._group(group_id).members)

    def group_status(self, group_id: int) -> GroupStatus:
        group = self._group(group_id)
        return GroupStatus(group_id, group.completed, len(group.members))

    def stats(self) -> TSStats:
        def by_v(state: TrajState) -> dict[int, int]:
            return dict(sorted((v, n) for v, n in self._counts[state].items() if v is not None))

        return TSStats(
            capacity_groups=self._capacity,
            groups=len(self._groups),
            queued=self._counts[QUEUED].total(),
            routed=self._counts[ROUTED].total(),
            completed=self._counts[COMPLETED].total(),
            initial=self._counts[QUEUED][None],
            queued_by_v=by_v(QUEUED),
            routed_by_v=by_v(ROUTED),
            completed_by_v=by_v(COMPLETED),
            created_trajectories=self._next_traj,
            consumed_trajectories=self._consumed_trajs,
            aborted_trajectories=self._aborted_trajs,
            created_groups=self._next_group,
            consumed_groups=self._consumed_groups,
            aborted_groups=self._aborted_groups,
            dataset_exhausted=self._exhausted,
        )

    # ------------------------------------------------------------ transitions

    def refill(self) -> tuple[int, ...]:
        """Sample prompts into new groups of initial trajectories while below capacity.

        Returns the new group ids.
        """
        new: list[int] = []
        while len(self._groups) < self._capacity and not self._exhausted:
            sample = self._source.next_sample()
            if sample is None:
                self._exhausted = True
                logger.info("prompt source exhausted after %d groups", self._next_group)
                break
            new.append(self._add_group(sample.sample_id, sample.answer, sample.prompt_ids))
        if new:
            logger.debug("refill: %d new groups, %d held", len(new), len(self._groups))
        return tuple(new)

    def route(
        self,
        traj_ids: Iterable[int],
        v_traj: int | Mapping[int, int] | None,
        instance_id: InstanceId,
        *,
        skip_unavailable: bool = False,
    ) -> tuple[RoutedTrajectory, ...]:
        """Hand QUEUED trajectories to ``instance_id`` and mark them ROUTED.

        ``v_traj``: one version for all, or one per trajectory id. Initial trajectories
        get theirs here; partial ones keep theirs and may only be given the same value
        (or None). The payload arrays are read-only and shared with the server.

        ``skip_unavailable``: route only those still QUEUED and leave out the rest (gone,
        or no longer QUEUED) instead of raising; a router whose view of the queue is a
        moment old uses it, and learns what it missed from the ids absent from the result.
        """
        if isinstance(instance_id, bool) or not isinstance(instance_id, int | str):
            raise InvalidPayload(f"instance_id must be an int or a str, got {instance_id!r}")
        ids = _unique(traj_ids, "route")
        per_traj = v_traj if isinstance(v_traj, Mapping) else None
        if per_traj is not None and not set(per_traj) <= set(ids):
            extra = sorted(set(per_traj) - set(ids))
            raise VersionConflict(f"v_traj names trajectories {extra} that route was not given")
        plan: list[tuple[_Traj, int]] = []
        for tid in ids:
            if skip_unavailable:
                live = self._trajs.get(tid)
                if live is None or live.state is not QUEUED:
                    continue
            traj = self._lookup(tid)
            if traj.state is not QUEUED:
                raise InvalidTransition(
                    f"{traj.describe()}; route takes QUEUED trajectories only "
                    "(interrupt it and pass it to interrupt_return first)"
                )
            v = per_traj.get(tid) if per_traj is not None else v_traj
            plan.append((traj, self._resolve_version(traj, v)))  # type: ignore[arg-type]
        out = []
        for traj, v in plan:
            self._mlq.remove(traj.traj_id, traj.v_traj)
            self._set_state(traj, ROUTED, v)
            traj.instance_id = instance_id
            g = traj.group
            out.append(
                RoutedTrajectory(
                    traj_id=traj.traj_id,
                    group_id=g.group_id,
                    v_traj=v,
                    sample_id=g.sample_id,
                    answer=g.answer,
                    prompt=g.prompt,
                    tokens=traj.tokens,
                    logprobs=traj.logprobs,
                    versions=traj.versions,
                )
            )
        return tuple(out)

    def interrupt_return(self, partials: Iterable[PartialTrajectory]) -> None:
        """Take back interrupted ROUTED trajectories (``PartialTrajectory``-like records
        with the whole response so far). They keep their ``V_traj`` and re-enter the back
        of their MLQ level."""
        items = list(partials)
        _unique((p.traj_id for p in items), "interrupt_return")
        plan = []
        for p in items:
            traj = self._routed(p.traj_id, "interrupt_return")
            plan.append((traj, self._check_response(traj, p.tokens, p.logprobs, p.versions)))
        for traj, (tokens, logprobs, versions) in plan:
            traj.tokens, traj.logprobs, traj.versions = tokens, logprobs, versions
            traj.instance_id = None
            self._set_state(traj, QUEUED, traj.v_traj)
            self._mlq.push(traj.record())

    def complete(
        self,
        traj_id: int,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        reward: float,
        finish_reason: str,
        info: Mapping[str, InfoValue] | None = None,
    ) -> GroupStatus:
        """Store a finished, rewarded ROUTED trajectory (its whole response)."""
        c = Completion(traj_id, tokens, logprobs, versions, reward, finish_reason, info or {})
        return self.complete_many((c,))[0]

    def complete_many(self, completions: Iterable[Completion]) -> tuple[GroupStatus, ...]:
        items = list(completions)
        _unique((c.traj_id for c in items), "complete_many")
        plan = []
        for c in items:
            traj = self._routed(c.traj_id, "complete")
            arrays = self._check_response(traj, c.tokens, c.logprobs, c.versions)
            reward = validate.reward(c.traj_id, c.reward)
            if not isinstance(c.finish_reason, str):
                raise InvalidPayload(f"trajectory {c.traj_id}: finish_reason must be a str")
            info = dict(c.info)
            if not all(
                isinstance(k, str) and isinstance(v, int | float | str) for k, v in info.items()
            ):
                raise InvalidPayload(
                    f"trajectory {c.traj_id}: info must map str to int, float or str, got {info!r}"
                )
            plan.append((traj, arrays, reward, c.finish_reason, info))
        out = []
        for traj, (tokens, logprobs, versions), reward, finish_reason, info in plan:
            traj.tokens, traj.logprobs, traj.versions = tokens, logprobs, versions
            traj.reward, traj.finish_reason, traj.info = reward, finish_reason, info
            traj.instance_id = None
            self._set_state(traj, COMPLETED, traj.v_traj)
            traj.group.completed += 1
            out.append(
                GroupStatus(traj.group.group_id, traj.group.completed, len(traj.group.members))
            )
        return tuple(out)

    def take_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
    ) -> TrainingBatch:
        """Hand the completed trajectories of consumed groups to the trainer and forget
        the groups. ``select`` restricts a group to the given completed trajectory ids.
        Members not taken are dropped and reported in ``TrainingBatch.dropped``."""
        gids = _unique(group_ids, "take_batch")
        if select is not None and not set(select) <= set(gids):
            extra = sorted(set(select) - set(gids))
            raise InvalidTransition(f"select names groups {extra} that take_batch was not given")
        plan: list[tuple[_Group, list[_Traj]]] = []
        for gid in gids:
            group = self._group(gid)
            chosen = select.get(gid) if select is not None else None
            if chosen is None:
                taken = [t for t in group.members.values() if t.state is COMPLETED]
            else:
                taken = [self._member(group, tid) for tid in _unique(chosen, f"select[{gid}]")]
            if not taken:
                raise InvalidTransition(
                    f"group {gid} has no completed trajectories to take; wait for them, or "
                    "abort_group it"
                )
            plan.append((group, taken))
        groups, dropped = [], []
        for group, taken in plan:
            trajectories = tuple(
                TrainingTrajectory(
                    traj_id=t.traj_id,
                    v_traj=t.v_traj,  # type: ignore[arg-type]  # COMPLETED implies set
                    tokens=t.tokens,
                    logprobs=t.logprobs,
                    versions=t.versions,
                    reward=t.reward,
                    finish_reason=t.finish_reason,
                    info=t.info,
                )
                for t in taken
            )
            groups.append(
                TrainingGroup(
                    group_id=group.group_id,
                    sample_id=group.sample_id,
                    answer=group.answer,
                    prompt=group.prompt,
                    trajectories=trajectories,
                )
            )
            for t in taken:
                self._drop(t)
            self._consumed_trajs += len(taken)
            for t in list(group.members.values()):
                dropped.append(self._drop(t))
            del self._groups[group.group_id]
            self._consumed_groups += 1
        self._aborted_trajs += len(dropped)
        self._after_groups_left()
        return TrainingBatch(tuple(groups), tuple(dropped), self.config.temperature)

    def abort(self, traj_ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]:
        """Drop trajectories for good, in any state. A group left empty is removed."""
        ids = _unique(traj_ids, "abort")
        trajs = [self._lookup(tid) for tid in ids]
        out = tuple(self._drop(t) for t in trajs)
        self._aborted_trajs += len(out)
        emptied = {t.group.group_id for t in trajs if not t.group.members}
        for gid in emptied:
            del self._groups[gid]
        self._aborted_groups += len(emptied)
        if emptied:
            self._after_groups_left()
        return out

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        """Drop a whole group (e.g. batch-level redundancy surplus)."""
        return self.abort(tuple(self._group(group_id).members))

    # ---------------------------------------------------------------- helpers

    def _add_group(self, sample_id: int, answer: str, prompt_ids: object) -> int:
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or len(prompt) == 0 or prompt.dtype.kind not in "iu":
            raise InvalidPayload(
                f"sample {sample_id}: prompt_ids must be a non-empty 1-D integer array, got "
                f"shape {prompt.shape} dtype {prompt.dtype}; fix the prompt source"
            )
        # shared by the group's trajectories and every payload, so it must not change
        prompt = validate.frozen(prompt.astype(np.int32, copy=False))
        group = _Group(self._next_group, int(sample_id), str(answer), prompt)
        self._next_group += 1
        self._groups[group.group_id] = group
        for _ in range(self._per_group):
            traj = _Traj(self._next_traj, group)
            self._next_traj += 1
            group.members[traj.traj_id] = traj
            self._trajs[traj.traj_id] = traj
            self._counts[QUEUED][None] += 1
            self._mlq.push(traj.record())
        return group.group_id

    def _lookup(self, traj_id: int) -> _Traj:
        traj = self._trajs.get(traj_id)
        if traj is not None:
            return traj
        if isinstance(traj_id, int | np.integer) and 0 <= traj_id < self._next_traj:
            raise TrajectoryGone(
                f"trajectory {traj_id} was already consumed or aborted; drop this late message"
            )
        raise UnknownTrajectory(f"trajectory {traj_id!r} was never created by this server")

    def _group(self, group_id: int) -> _Group:
        group = self._groups.get(group_id)
        if group is None:
            gone = isinstance(group_id, int | np.integer) and 0 <= group_id < self._next_group
            why = "was already consumed or aborted" if gone else "was never created by this server"
            raise UnknownGroup(f"group {group_id!r} {why}")
        return group

    def _member(self, group: _Group, traj_id: int) -> _Traj:
        traj = self._lookup(traj_id)
        if traj.group is not group:
            raise InvalidTransition(
                f"trajectory {traj_id} belongs to group {traj.group.group_id}, not {group.group_id}"
            )
        if traj.state is not COMPLETED:
            raise InvalidTransition(f"{traj.describe()}; take_batch takes COMPLETED ones only")
        return traj

    def _routed(self, traj_id: int, call: str) -> _Traj:
        traj = self._lookup(traj_id)
        if traj.state is not ROUTED:
            raise InvalidTransition(f"{traj.describe()}; {call} takes ROUTED trajectories only")
        return traj

    def _resolve_version(self, traj: _Traj, v: object) -> int:
        if traj.v_traj is not None:
            if v is not None and v != traj.v_traj:
                raise VersionConflict(
                    f"trajectory {traj.traj_id} is a partial with V_traj={traj.v_traj}; route "
                    f"asked for V_traj={v}, but a V_traj never changes — pass {traj.v_traj} or None"
                )
            return traj.v_traj
        if v is None:
            raise VersionConflict(
                f"trajectory {traj.traj_id} is initial and needs a V_traj; pass the target "
                "instance's model version (checked with the staleness manager first)"
            )
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise VersionConflict(f"V_traj must be a non-negative int, got {v!r}")
        return int(v)

    def _check_response(
        self, traj: _Traj, tokens: object, logprobs: object, versions: object
    ) -> validate.Response:
        return validate.response(
            traj.traj_id,
            tokens,
            logprobs,
            versions,
            v_traj=traj.v_traj,  # type: ignore[arg-type]  # ROUTED implies set
            prefix_tokens=traj.tokens,
            prefix_versions=traj.versions,
        )

    def _set_state(self, traj: _Traj, state: TrajState, v: int | None) -> None:
        self._uncount(traj)
        self._counts[state][v] += 1
        traj.state, traj.v_traj = state, v

    def _uncount(self, traj: _Traj) -> None:
        counts = self._counts[traj.state]
        counts[traj.v_traj] -= 1
        if not counts[traj.v_traj]:
            del counts[traj.v_traj]  # versions come and go; keep stats() O(live levels)

    def _drop(self, traj: _Traj) -> AbortedTrajectory:
        """Forget one trajectory (the caller does the consumed/aborted accounting)."""
        if traj.state is QUEUED:
            self._mlq.remove(traj.traj_id, traj.v_traj)
        elif traj.state is COMPLETED:
            traj.group.completed -= 1
        self._uncount(traj)
        del self._trajs[traj.traj_id]
        del traj.group.members[traj.traj_id]
        return AbortedTrajectory(traj.traj_id, traj.group.group_id, traj.state, traj.instance_id)

    def _after_groups_left(self) -> None:
        if self._config.auto_refill:
            self.refill()
