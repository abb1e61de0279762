"""Rebuild the staleness manager and the trajectory server from a checkpoint, and make
them agree.

The two states are exported one after the other (the manager first, on the control
thread with its loop paused; then the TS). In between, only actors that never touch the
manager act on the TS: instances (interrupt, progress, hand-off to reward: nothing the
manager tracks) and reward workers, which store a completion in the TS *before* they
report it to the control plane. So the TS may hold completions the manager has not
applied yet, and nothing else may differ. :func:`reconcile` replays those completions
(Occupy, in trajectory id order) and checks every other correspondence; a checkpoint
where they disagree otherwise is refused rather than guessed at. With dynamic sampling on,
a group a replayed completion completes is filtered as the control loop would filter it
(its rewards are the TS's).

After the restore, trajectories that were ROUTED are QUEUED partials with their
``V_traj`` (``TrajectoryServer.restore``) and their reservations are still in the
manager, so the staleness bound holds for the first buffers after the resume exactly as
for every other: no Reserve is repeated and no entry is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from staleflow.control.dynamic_sampling import DynamicSampling, SamplingConfig
from staleflow.recovery.checkpoint import STALENESS_FILE, Checkpoint
from staleflow.recovery.errors import CorruptCheckpoint
from staleness import StalenessManager
from staleness.errors import StalenessError
from trajectory_server import TrajectoryServer, TrajectoryServerConfig, TrajState
from trajectory_server.errors import TrajectoryServerError
from trajectory_server.interface import PromptSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What :func:`reconcile` changed."""

    replayed: tuple[int, ...] = ()  # completions the manager had not applied
    aborted: tuple[int, ...] = ()  # trajectories the replayed Occupies dropped (surplus)
    filtered: tuple[int, ...] = ()  # trajectories of groups dynamic sampling dropped


def restore_run(
    checkpoint: Checkpoint,
    ts_config: TrajectoryServerConfig,
    source: PromptSource,
    sampling: SamplingConfig | None = None,
) -> tuple[StalenessManager, TrajectoryServer, Reconciliation]:
    """The manager and the TS of a checkpoint, in process and reconciled. A launcher on
    Ray restores them here and hands ``export_state()`` of each to its actors.

    ``source`` must be at the saved position (``PromptSampler.from_state(dataset,
    checkpoint.sampler)``); ``sampling``: the run's dynamic sampling, if on. Errors are ``CorruptCheckpoint`` (the saved states do not
    fit together) or the typed errors of each restore (another run's settings).
    """
    try:
        manager = StalenessManager.restore(dict(checkpoint.staleness))
    except StalenessError as exc:
        # a saved state the protocol refuses is the file's fault (CorruptState), whatever
        # the value: name the file, so the user knows which checkpoint to leave behind
        raise CorruptCheckpoint(f"{checkpoint.path / STALENESS_FILE}: {exc}") from exc
    ts = TrajectoryServer.restore(ts_config, source, checkpoint.trajectories)
    if manager.version != checkpoint.version:
        raise CorruptCheckpoint(
            f"{checkpoint.path}: staleness version {manager.version} is not the run's "
            f"version {checkpoint.version}"
        )
    return manager, ts, reconcile(manager, ts, sampling)


def reconcile(
    manager: StalenessManager, ts: TrajectoryServer, sampling: SamplingConfig | None = None
) -> Reconciliation:
    """Replay the completions the TS holds and the manager has not applied; check that
    everything else corresponds (see the module docstring)."""
    state = manager.export_state()
    groups = {g["id"]: g for g in state["groups"]}
    replay: list[tuple[int, int]] = []
    in_ts: set[int] = set()
    for t in ts.ledger():
        in_ts.add(t.traj_id)
        if t.v_traj is None:
            continue  # an initial trajectory: never reserved
        group = groups.get(t.group_id)
        members = dict(map(tuple, group["members"])) if group else {}
        if members.get(t.traj_id) != t.v_traj:
            _disagree(
                f"trajectory {t.traj_id} (group {t.group_id}, V_traj={t.v_traj}) has no such "
                "reservation"
            )
        done = t.traj_id in group["completed"]  # type: ignore[index]
        if t.state is TrajState.COMPLETED and not done:
            replay.append((t.group_id, t.traj_id))
        elif done and t.state is not TrajState.COMPLETED:
            _disagree(
                f"trajectory {t.traj_id} is completed in the manager but {t.state.value} in the TS"
            )
    for gid, group in groups.items():
        if group["buffer"] is None:  # occupied groups keep their surplus members on record
            lost = sorted(t for t, _ in group["members"] if t not in in_ts)
            if lost:
                _disagree(f"group {gid} is reserved for trajectories {lost} the TS lost")
    aborted: list[int] = []
    filtered: list[int] = []
    sampler = DynamicSampling(sampling) if sampling is not None else None
    if sampler is not None:
        sampler.seed(ts.ledger())
    for gid, tid in sorted(replay, key=lambda x: x[1]):
        keep = _keeper(sampler, manager, gid) if sampler is not None else None
        outcome = manager.complete(gid, tid, keep)
        drop = list(outcome.abort_trajectories)
        for g in outcome.abort_groups:
            try:
                drop.extend(ts.group_members(g))
            except TrajectoryServerError:
                continue  # the group is already gone from the TS
        live = [t for t in dict.fromkeys(drop) if _live(ts, t)]
        aborted.extend(a.traj_id for a in ts.abort(live))
        if outcome.filtered:
            filtered.extend(a.traj_id for a in ts.filter_group(gid))
    if replay:
        logger.info(
            "restore: %d completions replayed, %d surplus dropped, %d filtered",
            len(replay),
            len(aborted),
            len(filtered),
        )
    replayed = tuple(t for _, t in sorted(replay, key=lambda x: x[1]))
    return Reconciliation(replayed, tuple(aborted), tuple(filtered))


def _keeper(
    sampler: DynamicSampling, manager: StalenessManager, gid: int
) -> Callable[[Sequence[int]], bool]:
    """Dynamic sampling's decision on group ``gid``, as the control loop asks it."""
    return lambda kept: sampler.keeps(gid, kept, manager.filtered_this_step)


def _live(ts: TrajectoryServer, traj_id: int) -> bool:
    try:
        ts.state_of(traj_id)
    except TrajectoryServerError:
        return False
    return True


def _disagree(what: str) -> None:
    raise CorruptCheckpoint(
        f"the staleness manager and the trajectory server of this checkpoint disagree: "
        f"{what}; was it written without pausing the control loop, or edited?"
    )
