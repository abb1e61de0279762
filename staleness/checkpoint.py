"""Export / restore of the staleness manager's state (plain data, versioned format).

Format 2 adds the aborted group ids (a straggler of an aborted group must still be
discarded after a restore, and its id must take no new Reserve) and the consumed
batches' staleness history. Format 3 adds the counts of dynamic sampling: groups filtered
in all and since the last Consume (the filter's budget per step); a format 2 state
restores with both at 0 (it was written before filtering existed). Format 1 states are
refused: restoring one would forget the aborted groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from staleness.errors import CorruptState, InvalidConfig
from staleness.feasibility import AdmissionCounts
from staleness.types import StalenessConfig

FORMAT = 3
READABLE = (2, 3)
PROTOCOL_KEYS = ("eta", "batch_size", "group_size", "batch_redundancy", "group_redundancy")


@dataclass(frozen=True)
class SavedState:
    config: StalenessConfig
    version: int
    groups: list[dict[str, Any]]  # ring by ring, in arrival order (see export_state)
    aborted: list[int]  # remembered aborted group ids, oldest first
    consumed_batches: int
    aborted_groups: int
    history: list[tuple[int, tuple[int, ...]]]  # (buffer version, staleness per group)
    filtered_groups: int = 0
    filtered_this_step: int = 0


def config_dict(config: StalenessConfig) -> dict[str, Any]:
    """The protocol settings as plain data; a resumed run must use the same ones."""
    return {key: getattr(config, key) for key in PROTOCOL_KEYS}


def export_state(saved: SavedState) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "config": config_dict(saved.config),
        "version": saved.version,
        "groups": saved.groups,
        "aborted": list(saved.aborted),
        "consumed_batches": saved.consumed_batches,
        "aborted_groups": saved.aborted_groups,
        "history": [[v, list(s)] for v, s in saved.history],
        "filtered_groups": saved.filtered_groups,
        "filtered_this_step": saved.filtered_this_step,
    }


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorruptState(f"staleness state {what} must be an int >= 0, got {value!r}")
    return value


# what a damaged or edited state can do about it: the saved state is the thing at fault
_RESTORE_FIX = (
    "the saved state was damaged or edited: restore an earlier one (a run keeps its newest "
    "checkpoints in checkpoints/), not this one"
)


def _saved_config(raw: object) -> StalenessConfig:
    """The saved protocol settings. A value the protocol refuses (``batch_size=0``) is a
    fault of the saved state, not of a configuration: ``CorruptState``, not
    ``InvalidConfig``."""
    if not isinstance(raw, dict):
        raise CorruptState(
            f"staleness state field 'config' must be a dict of {', '.join(PROTOCOL_KEYS)}, "
            f"got {raw!r}; {_RESTORE_FIX}"
        )
    unknown = sorted(map(str, set(raw) - set(PROTOCOL_KEYS)))
    missing = [key for key in PROTOCOL_KEYS if key not in raw]
    if unknown or missing:
        raise CorruptState(
            f"staleness state field 'config' has unknown keys {unknown} or lacks {missing}; "
            f"{_RESTORE_FIX}"
        )
    try:
        return StalenessConfig(**raw)
    except InvalidConfig as exc:
        raise CorruptState(f"staleness state field 'config': {exc}. Here {_RESTORE_FIX}") from exc


def parse_state(state: Any) -> SavedState:
    """Check the shape of a saved state; every problem names the field to fix."""
    if not isinstance(state, dict):
        raise CorruptState(
            f"a staleness state is a dict from export_state(), got {type(state).__name__}"
        )
    if state.get("format") not in READABLE:
        raise CorruptState(
            f"unsupported staleness state format {state.get('format')!r}; expected one of "
            f"{READABLE}"
        )
    config = _saved_config(state.get("config"))
    try:
        saved = SavedState(
            config,
            state["version"],
            list(state["groups"]),
            list(state["aborted"]),
            _count(state["consumed_batches"], "'consumed_batches'"),
            _count(state["aborted_groups"], "'aborted_groups'"),
            [(_count(v, "history version"), tuple(s)) for v, s in state["history"]],
            _count(state.get("filtered_groups", 0), "'filtered_groups'"),
            _count(state.get("filtered_this_step", 0), "'filtered_this_step'"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CorruptState):
            raise
        raise CorruptState(f"staleness state is missing or has a bad field: {exc}") from exc
    version, eta = _count(saved.version, "'version'"), config.eta
    seen: set[int] = set()
    for i, g in enumerate(saved.groups):
        try:
            gid, v, buffer, members = g["id"], g["version"], g["buffer"], g["members"]
            completed, dropped = g["completed"], g["dropped"]
        except (KeyError, TypeError) as exc:
            raise CorruptState(f"staleness state group #{i} lacks field {exc}") from exc
        if gid in seen:
            raise CorruptState(f"staleness state lists group {gid} twice")
        seen.add(gid)
        member_ids = [m[0] for m in members]
        counted = [m[1] for m in members if buffer is None or m[0] in completed]
        if not counted or v != min(counted):
            raise CorruptState(f"group {gid}: version {v} is not the minimum V_traj of its members")
        if len(set(member_ids)) != len(member_ids) or not set(completed) <= set(member_ids):
            raise CorruptState(f"group {gid}: completed trajectories must be distinct members")
        if (buffer is not None) != (len(completed) >= config.group_size):
            raise CorruptState(f"group {gid}: 'buffer' must be set exactly when it is occupied")
        if not isinstance(dropped, int) or dropped < 0:
            raise CorruptState(f"group {gid}: 'dropped' must be an int >= 0")
        if v > version or v + eta < version:
            raise CorruptState(f"group {gid}: version {v} is outside [{version - eta}, {version}]")
        if buffer is not None and not version <= buffer <= v + eta:
            raise CorruptState(f"group {gid}: buffer {buffer} is outside [{version}, {v + eta}]")
    if len(set(saved.aborted)) != len(saved.aborted) or seen & set(saved.aborted):
        raise CorruptState("staleness state 'aborted' must list distinct ids of untracked groups")
    return saved


def check_fits(counts: AdmissionCounts) -> None:
    """The restored groups must fit the buffers, as they did when they were saved."""
    if max(counts.pinned_by_buffer()) > counts.batch_size or min(counts.slack()) < 0:
        raise CorruptState(
            "the saved groups do not fit within eta of the saved version; "
            "was the state edited, or saved with another eta or batch_size?"
        )
