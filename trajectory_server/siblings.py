"""The responses of a group's members, for the instances running its other members: the
draft source of grouped speculative decoding (docs/speculation.md) in each instance
drafts from them. The TS has them already (progress reports, interrupts, completions), so
it serves them; an instance asks with the lengths it has, so that each call sends only
the tokens added since."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from trajectory_server.errors import InvalidPayload
from trajectory_server.records import ROUTED
from trajectory_server.store import TrajectoryStore
from trajectory_server.types import InstanceId, SiblingResponses, SiblingTokens


def group_responses(
    store: TrajectoryStore,
    known: Mapping[int, Mapping[int, int]],
    instance_id: InstanceId | None,
    watch: Iterable[int],
) -> SiblingResponses:
    """For each group of ``known``, the tokens of each member's response beyond
    ``known[group][member]`` (0 if absent), leaving out members ROUTED to
    ``instance_id`` (it has them); and which groups of ``known`` and ``watch`` are gone."""
    asked = _checked(known, watch)
    out: list[SiblingTokens] = []
    gone = []
    for gid, have in asked:
        group = store.groups.get(gid)
        if group is None:
            gone.append(gid)
            continue
        if have is None:
            continue
        for tid, traj in group.members.items():
            if traj.state is ROUTED and traj.holder == instance_id:
                continue
            start = have.get(tid, 0)
            if len(traj.tokens) > start:
                out.append(SiblingTokens(gid, tid, start, traj.tokens[start:]))
    return SiblingResponses(tuple(out), tuple(gone))


def _checked(
    known: Mapping[int, Mapping[int, int]], watch: Iterable[int]
) -> list[tuple[int, Mapping[int, int] | None]]:
    """``(group, lengths known)`` for the groups asked for tokens, then ``(group, None)``
    for those only watched; raises on anything but ints (a malformed request)."""
    if not isinstance(known, Mapping):
        raise InvalidPayload(
            f"known must map group ids to {{trajectory: length}}, got {known!r:.80}"
        )
    asked: list[tuple[int, Mapping[int, int] | None]] = []
    for gid, have in known.items():
        if not _int(gid) or not isinstance(have, Mapping):
            raise InvalidPayload(f"known[{gid!r}] must map trajectory ids to lengths")
        if not all(_int(t) and _int(n) and n >= 0 for t, n in have.items()):
            raise InvalidPayload(f"known[{gid}] must map trajectory ids to lengths >= 0")
        asked.append((gid, have))
    for gid in watch:
        if not _int(gid):
            raise InvalidPayload(f"watch must hold group ids, got {gid!r}")
        if gid not in known:
            asked.append((gid, None))
    return asked


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
