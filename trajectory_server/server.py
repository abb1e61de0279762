"""The trajectory server core (paper §5.1): every trajectory in flight, as a state machine.

Life of a trajectory::

    refill ─► QUEUED ──route──► ROUTED ─────────complete──────────► COMPLETED ──take_batch──►
                 ▲               │  │                               ▲            consumed
                 ├─interrupt_return  └─hand_to_reward─► REWARDING ──┘
                 └──requeue / instance_lost ┘           (reassign_rewards: another worker)

    abort / abort_group (any state) ─► aborted
    filter_group (a completed group, dynamic sampling) ─► filtered

While ROUTED, an instance may ``report_progress``: the TS keeps the longest response it
knows, and a trajectory whose instance is lost goes back to the queue with it (keeping its
``V_traj``; its reservation in the staleness manager is untouched). ``export_state`` /
``restore`` (``persist.py``) checkpoint the whole server.

Every public method validates its whole input before it changes anything, so a call that
raises leaves the server as it was. Plain class, single-threaded; ``actor.py`` serves it
over Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from trajectory_server import payloads, persist, siblings, validate
from trajectory_server.errors import InvalidPayload, InvalidTransition, NotHolder, VersionConflict
from trajectory_server.interface import PromptSource
from trajectory_server.records import (
    COMPLETED,
    QUEUED,
    REWARDING,
    ROUTED,
    GroupRecord,
    TrajRecord,
    unique,
)
from trajectory_server.store import TrajectoryStore
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    InfoValue,
    InstanceId,
    LiveTrajectory,
    NextTurn,
    PartialTrajectory,
    RewardTask,
    RoutableTrajectory,
    RoutedTrajectory,
    SiblingResponses,
    TrainingBatch,
    TrajectoryServerConfig,
    TrajState,
    TSStats,
    WorkerId,
)

logger = logging.getLogger(__name__)


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
        self._s = TrajectoryStore()
        if fill:
            self.refill()

    @property
    def config(self) -> TrajectoryServerConfig:
        return self._config

    # ----------------------------------------------------------------- views

    def routing_view(self) -> Sequence[RoutableTrajectory]:
        """The QUEUED trajectories in MLQ order. O(1) when nothing changed since last call."""
        return self._s.mlq.view()

    def state_of(self, traj_id: int) -> TrajState:
        return self._s.lookup(traj_id).state

    def group_members(self, group_id: int) -> tuple[int, ...]:
        """Live trajectory ids of a group, in creation order."""
        return tuple(self._s.group(group_id).members)

    def group_status(self, group_id: int) -> GroupStatus:
        group = self._s.group(group_id)
        return GroupStatus(group_id, group.completed, len(group.members))

    def ledger(self) -> tuple[LiveTrajectory, ...]:
        """Every live trajectory with its state, ``V_traj``, holder and (completed and
        graded) reward, by id (no payloads)."""
        return tuple(t.live() for _, t in sorted(self._s.trajs.items()))

    def routed_to(self, instance_id: InstanceId) -> tuple[int, ...]:
        """Ids of the trajectories ROUTED to ``instance_id`` (for audits and recovery)."""
        return self._s.routed_to(instance_id)

    def group_responses(
        self,
        known: Mapping[int, Mapping[int, int]],
        instance_id: InstanceId | None = None,
        watch: Iterable[int] = (),
    ) -> SiblingResponses:
        """The responses of ``known``'s groups past the lengths given, but those ROUTED to
        ``instance_id``, and the asked groups that are gone (grouped drafts: siblings.py)."""
        return siblings.group_responses(self._s, known, instance_id, watch)

    def tool_waits(self) -> tuple[tuple[RoutableTrajectory, InstanceId], ...]:
        """Every REWARDING trajectory whose last model turn ended on a known instance,
        with that instance: in a multi-turn task each of them waits on its environment
        (a tool call, then its next turn or its score). The coordinator lists them in the
        snapshot of that instance (``InstanceSnapshot.env_trajs``)."""
        return tuple(
            (t.record(), t.turned_on)
            for t in self._s.trajs.values()
            if t.state is REWARDING and t.turned_on is not None
        )

    def stats(self) -> TSStats:
        return self._s.stats(self._capacity)

    # ------------------------------------------------------------ transitions

    def refill(self) -> tuple[int, ...]:
        """Sample prompts into new groups of initial trajectories while below capacity.

        Returns the new group ids.
        """
        new: list[int] = []
        while len(self._s.groups) < self._capacity and not self._s.exhausted:
            sample = self._source.next_sample()
            if sample is None:
                self._s.exhausted = True
                logger.info("prompt source exhausted after %d groups", self._s.next_group)
                break
            new.append(
                self._s.add_group(
                    sample.sample_id, sample.answer, sample.prompt_ids, self._per_group
                )
            )
        if new:
            logger.debug("refill: %d new groups, %d held", len(new), len(self._s.groups))
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
        validate.holder_id(instance_id, "instance_id")
        if instance_id in self._s.lost:
            raise NotHolder(
                f"instance {instance_id!r} was declared lost: route to its successor (a "
                "restarted instance has a holder id of its own)"
            )
        ids = unique(traj_ids, "route")
        per_traj = v_traj if isinstance(v_traj, Mapping) else None
        if per_traj is not None and not set(per_traj) <= set(ids):
            extra = sorted(set(per_traj) - set(ids))
            raise VersionConflict(f"v_traj names trajectories {extra} that route was not given")
        plan: list[tuple[TrajRecord, int]] = []
        for tid in ids:
            if skip_unavailable:
                live = self._s.trajs.get(tid)
                if live is None or live.state is not QUEUED:
                    continue
            traj = self._s.lookup(tid)
            if traj.state is not QUEUED:
                raise InvalidTransition(
                    f"{traj.describe()}; route takes QUEUED trajectories only "
                    "(interrupt it and pass it to interrupt_return first)"
                )
            v = per_traj.get(tid) if per_traj is not None else v_traj
            plan.append((traj, validate.route_version(traj.traj_id, traj.v_traj, v)))  # type: ignore[arg-type]
        out = []
        for traj, v in plan:
            self._s.mlq.remove(traj.traj_id, traj.v_traj)
            self._s.set_state(traj, ROUTED, v)
            traj.holder = instance_id
            out.append(payloads.routed(traj))
        return tuple(out)

    def fork(self, traj_id: int, instance_id: InstanceId) -> RoutedTrajectory | None:
        """What a race copy of a trajectory ROUTED to ``instance_id`` starts from (its
        response as last reported), or None if it is not routed there (any more). Changes
        nothing: the copy completes, if it wins, in its holder's name (runtime/controller/races.py)."""
        traj = self._s.trajs.get(traj_id)
        if traj is None or traj.state is not ROUTED or traj.holder != instance_id:
            return None
        return payloads.routed(traj)

    def interrupt_return(
        self, partials: Iterable[PartialTrajectory], *, instance_id: InstanceId | None = None
    ) -> None:
        """Take back interrupted ROUTED trajectories (``PartialTrajectory``-like records
        with the whole response so far). They keep their ``V_traj`` and re-enter the back
        of their MLQ level. With ``instance_id``, each must be ROUTED to that instance
        (``NotHolder`` otherwise: a late message from an instance declared lost)."""
        items = list(partials)
        unique((p.traj_id for p in items), "interrupt_return")
        plan = []
        for p in items:
            traj = self._routed(p.traj_id, "interrupt_return", instance_id)
            plan.append(
                (traj, self._check_response(traj, p.tokens, p.logprobs, p.versions, p.mask))
            )
        for traj, response in plan:
            self._store(traj, response)
            self._s.requeue(traj)

    def report_progress(
        self, partials: Iterable[PartialTrajectory], instance_id: InstanceId
    ) -> tuple[int, ...]:
        """An instance reports the responses of trajectories it is still generating. The
        TS keeps the longest one it knows, so that losing the instance costs only the
        tokens generated since its last report. Report only tokens that will stay in the
        response (each later report, interrupt or completion must start with them).

        Reports about trajectories that are not ROUTED to ``instance_id`` any more (gone,
        interrupted, requeued after a loss) are ignored; a malformed payload raises and
        records nothing. Returns the ids whose progress was recorded.
        """
        plan = []
        for p in partials:
            traj = self._s.trajs.get(p.traj_id)
            if traj is None or traj.state is not ROUTED or traj.holder != instance_id:
                continue
            if len(p.tokens) > len(traj.tokens):
                plan.append(
                    (traj, self._check_response(traj, p.tokens, p.logprobs, p.versions, p.mask))
                )
        unique((traj.traj_id for traj, _ in plan), "report_progress")
        for traj, response in plan:
            self._store(traj, response)
        return tuple(traj.traj_id for traj, _ in plan)

    def requeue(self, traj_ids: Iterable[int]) -> None:
        """Return ROUTED trajectories to the queue without their instance's cooperation
        (it is gone), with the longest response the TS knows; ``V_traj`` is kept."""
        trajs = [self._routed(tid, "requeue") for tid in unique(traj_ids, "requeue")]
        for traj in trajs:
            self._s.requeue(traj)

    def instance_lost(self, instance_id: InstanceId) -> tuple[int, ...]:
        """Every trajectory ROUTED to a lost instance goes back to the queue (see
        ``requeue``). Returns their ids. Later messages from that instance about them
        raise ``NotHolder`` when they name it (``instance_id=``), and a Route to it is
        refused (``NotHolder``): give each incarnation of an instance its own id."""
        validate.holder_id(instance_id, "instance_id")
        ids = self.routed_to(instance_id)
        self.requeue(ids)
        self._s.lost.add(instance_id)
        if ids:
            logger.info(
                "instance %r lost: %d trajectories back in the queue", instance_id, len(ids)
            )
        return ids

    def hand_to_reward(
        self,
        finished: Iterable[FinishedTrajectory],
        worker_id: WorkerId,
        *,
        instance_id: InstanceId | None = None,
    ) -> None:
        """ROUTED trajectories finished generating and go to reward worker ``worker_id``:
        the TS stores their whole response, so that another worker can score them if this
        one is lost (``reassign_rewards``). The completion must carry the same response."""
        validate.holder_id(worker_id, "worker_id")
        items = list(finished)
        unique((f.traj_id for f in items), "hand_to_reward")
        plan = []
        for f in items:
            traj = self._routed(f.traj_id, "hand_to_reward", instance_id)
            if not isinstance(f.finish_reason, str):
                raise InvalidPayload(f"trajectory {f.traj_id}: finish_reason must be a str")
            plan.append(
                (traj, self._check_response(traj, f.tokens, f.logprobs, f.versions, f.mask), f)
            )
        for traj, response, f in plan:
            self._store(traj, response)
            traj.finish_reason = f.finish_reason
            traj.holder, traj.turned_on = worker_id, instance_id
            self._s.set_state(traj, REWARDING, traj.v_traj)

    def next_turn(self, turns: Iterable[NextTurn], *, worker_id: WorkerId) -> None:
        """REWARDING trajectories of ``worker_id`` whose episode goes on: store the response
        with the observation appended and the environment's state, and queue them for
        their next model turn with their ``V_traj`` (``NotHolder`` when one is not with
        that worker any more: a late message). Only observation tokens (mask False) may
        be appended here; the model's own come from an instance."""
        items = list(turns)
        unique((n.traj_id for n in items), "next_turn")
        plan = []
        for n in items:
            traj = self._s.lookup(n.traj_id)
            late = traj.state is not REWARDING or traj.holder != worker_id
            if late or not validate.extends(n.tokens, traj.tokens):
                # not with this worker, or a resent step of an earlier turn: a late message
                raise NotHolder(f"{traj.describe()}, not this turn with {worker_id!r}: drop it")
            response = self._check_response(traj, n.tokens, n.logprobs, n.versions, n.mask)
            if response[3][len(traj.tokens) :].any() or not isinstance(n.env_state, bytes):
                raise InvalidPayload(
                    f"trajectory {n.traj_id}: next_turn appends observation tokens only (mask "
                    "False) and takes the environment's state as bytes"
                )
            plan.append((traj, response, n.env_state))
        for traj, response, env_state in plan:
            self._store(traj, response)
            traj.env_state, traj.finish_reason = env_state, ""
            self._s.requeue(traj)

    def env_states(self, traj_ids: Iterable[int]) -> dict[int, bytes]:
        """The packed environment state of each live trajectory of ``traj_ids``."""
        return {t: self._s.trajs[t].env_state for t in traj_ids if t in self._s.trajs}

    def reassign_rewards(
        self, from_worker: WorkerId | None, to_worker: WorkerId | None
    ) -> tuple[RewardTask, ...]:
        """Move every REWARDING trajectory of ``from_worker`` (None: those no worker has,
        e.g. after a restore) to ``to_worker`` (None: leave them waiting for one) and
        return what a worker needs to score them. A lost worker's trajectories are
        scored again elsewhere this way; nothing is regenerated."""
        if to_worker is not None:
            validate.holder_id(to_worker, "to_worker")
        moved = [
            t for t in self._s.trajs.values() if t.state is REWARDING and t.holder == from_worker
        ]
        for traj in moved:
            traj.holder = to_worker
        return tuple(payloads.reward_task(t) for t in moved)

    def complete(
        self,
        traj_id: int,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        reward: float,
        finish_reason: str,
        info: Mapping[str, InfoValue] | None = None,
        mask: np.ndarray | None = None,
    ) -> GroupStatus:
        """Store a finished, rewarded ROUTED trajectory (its whole response; ``mask``
        None: every token the model's)."""
        c = Completion(traj_id, tokens, logprobs, versions, reward, finish_reason, info or {}, mask)
        return self.complete_many((c,))[0]

    def complete_many(
        self,
        completions: Iterable[Completion],
        *,
        instance_id: InstanceId | None = None,
        worker_id: WorkerId | None = None,
    ) -> tuple[GroupStatus, ...]:
        """Store finished, rewarded trajectories: ROUTED ones (with ``instance_id``, each
        must be ROUTED to it) or REWARDING ones (their response must be the stored one).
        With ``worker_id``, each must be REWARDING with that worker (``NotHolder``
        otherwise: it was reassigned, or another worker scored it first)."""
        items = list(completions)
        unique((c.traj_id for c in items), "complete_many")
        plan = []
        for c in items:
            traj = self._s.lookup(c.traj_id)
            if worker_id is not None and (traj.state is not REWARDING or traj.holder != worker_id):
                raise NotHolder(
                    f"{traj.describe()}, not being scored by worker {worker_id!r}: it was "
                    "reassigned to another worker or already scored; drop this late completion"
                )
            if traj.state is REWARDING and validate.earlier_turn(c.tokens, traj.tokens):
                # a step resent after an instance loss ended the episode on a turn it left
                raise NotHolder(f"{traj.describe()}: a completion of an earlier turn: drop it")
            if traj.state is not REWARDING:
                traj = self._routed(c.traj_id, "complete", instance_id)
            arrays = self._check_response(traj, c.tokens, c.logprobs, c.versions, c.mask)
            if traj.state is REWARDING and len(arrays[0]) != len(traj.tokens):
                raise InvalidPayload(
                    f"trajectory {c.traj_id}: the completion has {len(arrays[0])} tokens but "
                    f"the finished response handed to reward has {len(traj.tokens)}; complete "
                    "it with the response the TS stored (see reassign_rewards)"
                )
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
        for traj, response, reward, finish_reason, info in plan:
            self._store(traj, response)
            traj.reward, traj.finish_reason, traj.info = reward, finish_reason, info
            traj.holder = None
            self._s.set_state(traj, COMPLETED, traj.v_traj)
            traj.group.completed += 1
            out.append(
                GroupStatus(traj.group.group_id, traj.group.completed, len(traj.group.members))
            )
        return tuple(out)

    def take_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
        read: Iterable[int] = (),
    ) -> TrainingBatch:
        """Hand the completed trajectories of consumed groups to the trainer and forget
        the groups. ``select`` restricts a group to the given completed trajectory ids.
        Members not taken are dropped and reported in ``TrainingBatch.dropped``. Groups in
        ``read`` (read already, :meth:`read_batch`) are forgotten but not handed back."""
        plan = self._batch_plan(group_ids, select, "take_batch")
        known = set(read)
        if extra := known - {group.group_id for group, _ in plan}:
            raise InvalidTransition(f"read names groups {sorted(extra)} not given to take")
        groups, dropped = [], []
        for group, taken in plan:
            if group.group_id not in known:
                groups.append(payloads.training_group(group, taken))
            for t in taken:
                self._s.drop(t)
            self._s.consumed_trajs += len(taken)
            for t in list(group.members.values()):
                dropped.append(self._s.drop(t))
            del self._s.groups[group.group_id]
            self._s.consumed_groups += 1
        self._s.aborted_trajs += len(dropped)
        self._after_groups_left()
        return TrainingBatch(tuple(groups), tuple(dropped), self.config.temperature)

    def read_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
    ) -> TrainingBatch:
        """What :meth:`take_batch` would hand out, changing nothing (``dropped`` stays
        empty). A streaming trainer (RolloutPipe) reads each occupied group of its buffer
        this way before the buffer is Consumed; the groups stay here, whole, until then,
        so a checkpoint cut taken meanwhile still holds them."""
        plan = self._batch_plan(group_ids, select, "read_batch")
        groups = tuple(payloads.training_group(group, taken) for group, taken in plan)
        return TrainingBatch(groups, (), self.config.temperature)

    def _batch_plan(
        self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]] | None, call: str
    ) -> list[tuple[GroupRecord, list[TrajRecord]]]:
        gids = unique(group_ids, call)
        if select is not None and not set(select) <= set(gids):
            extra = sorted(set(select) - set(gids))
            raise InvalidTransition(f"select names groups {extra} that {call} was not given")
        plan: list[tuple[GroupRecord, list[TrajRecord]]] = []
        for gid in gids:
            group = self._s.group(gid)
            chosen = select.get(gid) if select is not None else None
            if chosen is None:
                taken = [t for t in group.members.values() if t.state is COMPLETED]
            else:
                taken = [self._member(group, tid) for tid in unique(chosen, f"select[{gid}]")]
            if not taken:
                raise InvalidTransition(
                    f"group {gid} has no completed trajectories to take; wait for them, or "
                    "abort_group it"
                )
            plan.append((group, taken))
        return plan

    def abort(self, traj_ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]:
        """Drop trajectories for good, in any state. A group left empty is removed."""
        ids = unique(traj_ids, "abort")
        trajs = [self._s.lookup(tid) for tid in ids]
        out = tuple(self._s.drop(t) for t in trajs)
        self._s.aborted_trajs += len(out)
        emptied = {t.group.group_id for t in trajs if not t.group.members}
        for gid in emptied:
            del self._s.groups[gid]
        self._s.aborted_groups += len(emptied)
        if emptied:
            self._after_groups_left()
        return out

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        """Drop a whole group (e.g. batch-level redundancy surplus)."""
        return self.abort(tuple(self._s.group(group_id).members))

    def filter_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]:
        """Drop a completed group that dynamic sampling filtered out (its rewards were all
        equal): like :meth:`abort_group`, but counted in ``filtered_trajectories`` and
        ``filtered_groups``, so that the audit tells a group that taught nothing from
        work that was lost."""
        out = self._s.drop_filtered(self._s.group(group_id))
        self._after_groups_left()
        return out

    # ------------------------------------------------------------ checkpoints

    def export_state(self) -> dict[str, Any]:
        """Every live trajectory with its response, the group and id bookkeeping and the
        prompt source's position (if it has ``state()``), as plain data with 1-D arrays
        (see ``persist.py``). Consistent by construction: the server is single-threaded."""
        return persist.export_state(self._s, self._config, persist.source_state(self._source))

    @classmethod
    def restore(
        cls, config: TrajectoryServerConfig, source: PromptSource, state: Any
    ) -> TrajectoryServer:
        """A server holding what ``export_state()`` saved; trajectories that were ROUTED
        are QUEUED again with their longest known response and ``V_traj``, REWARDING ones
        wait for ``reassign_rewards(None, worker)``. ``source`` must be at the saved
        position. Refills nothing: call ``refill()`` to top up to a larger capacity."""
        server = cls(config, source, fill=False)
        requeued = persist.load(server._s, config, state, persist.source_state(source))
        if requeued:
            logger.info("restored: %d routed trajectories are queued again", len(requeued))
        return server

    # ---------------------------------------------------------------- helpers

    def _member(self, group: GroupRecord, traj_id: int) -> TrajRecord:
        traj = self._s.lookup(traj_id)
        if traj.group is not group:
            raise InvalidTransition(
                f"trajectory {traj_id} belongs to group {traj.group.group_id}, not {group.group_id}"
            )
        if traj.state is not COMPLETED:
            raise InvalidTransition(f"{traj.describe()}; take_batch takes COMPLETED ones only")
        return traj

    def _routed(self, traj_id: int, call: str, instance_id: InstanceId | None = None) -> TrajRecord:
        traj = self._s.lookup(traj_id)
        if instance_id is not None and (traj.state is not ROUTED or traj.holder != instance_id):
            raise NotHolder(
                f"{traj.describe()}, not on instance {instance_id!r}: {call} from an instance "
                "that no longer holds it (it was declared lost); drop this late message"
            )
        if traj.state is not ROUTED:
            raise InvalidTransition(f"{traj.describe()}; {call} takes ROUTED trajectories only")
        return traj

    def _store(self, traj: TrajRecord, response: validate.Response) -> None:
        traj.tokens, traj.logprobs, traj.versions, traj.mask = response

    def _check_response(
        self,
        traj: TrajRecord,
        tokens: object,
        logprobs: object,
        versions: object,
        mask: object,
    ) -> validate.Response:
        return validate.response(
            traj.traj_id,
            tokens,
            logprobs,
            versions,
            mask,
            v_traj=traj.v_traj,  # type: ignore[arg-type]  # ROUTED implies set
            prefix_tokens=traj.tokens,
            prefix_versions=traj.versions,
            prefix_mask=traj.mask,
        )

    def _after_groups_left(self) -> None:
        if self._config.auto_refill:
            self.refill()
