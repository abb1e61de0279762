"""Where each tracked group sits, for the dashboard and the tests.

Admission never needs this (``staleness.feasibility`` decides from counts). Occupied
groups sit in the buffer they are committed to; reserved groups are drawn as the paper's
worst-case Reserve places them: as late as their windows allow, newest deadline first.
"""

from __future__ import annotations

from collections.abc import Sequence

from staleness.types import BufferState, BufferView, Entry, EntryKind, GroupId

Bucket = Sequence[tuple[GroupId, int]]  # (group id, group version) in arrival order


def canonical_buffers(
    version: int,
    batch_size: int,
    capacity: int,
    reserved: Sequence[Bucket],
    pinned: Sequence[Bucket],
) -> tuple[BufferView, ...]:
    """Buffers ``version .. version + eta``.

    ``reserved[k]``: reserved groups whose deadline is ``k`` (version ``version-eta+k``).
    ``pinned[j]``: occupied groups committed to buffer ``version + j``.
    """
    n = len(reserved)
    entries = [[Entry(gid, v, EntryKind.OCCUPIED) for gid, v in pinned[j]] for j in range(n)]
    pending = [(k, gid, v) for k in range(n) for gid, v in reserved[k]]
    pending.reverse()  # newest deadlines claim the latest buffers first
    for j in range(n - 1, -1, -1):
        free = capacity - len(entries[j])
        keep = []
        for k, gid, v in pending:
            if free > 0 and k >= j:
                entries[j].append(Entry(gid, v, EntryKind.RESERVED))
                free -= 1
            else:
                keep.append((k, gid, v))
        pending = keep
    if pending:
        raise AssertionError("reserved groups do not fit the buffers: the invariant is broken")
    views = []
    for j in range(n):
        occupied = len(pinned[j])
        if occupied >= batch_size:
            state = BufferState.READY
        elif len(entries[j]) >= capacity:
            state = BufferState.STUCK
        else:
            state = BufferState.WAITING
        views.append(BufferView(version + j, state, capacity, tuple(entries[j])))
    return tuple(views)
