"""The rollout instances a control plane drives now: each one's handle and its holder id
in the trajectory server. Instances join (elastic rollout, a restart) and leave (lost,
removed) while commands run on other threads, so reads take a copy under a lock, and
asking for one that left raises :class:`~staleflow.runtime.interface.InstanceGone`."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

from coordinator.types import InstanceSnapshot
from staleflow.runtime.interface import InstanceGone, InstanceHandle
from trajectory_server.types import InstanceId


class Members(Mapping[int, InstanceHandle]):
    def __init__(
        self,
        handles: Mapping[int, InstanceHandle],
        holders: Mapping[int, InstanceId] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._handles = dict(handles)
        self._holders: dict[int, InstanceId] = {i: i for i in self._handles}
        self._holders.update(holders or {})

    def __getitem__(self, inst: int) -> InstanceHandle:
        with self._lock:
            handle = self._handles.get(inst)
        if handle is None:
            raise InstanceGone(inst, "it left the run")
        return handle

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter(list(self._handles))

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)

    def __contains__(self, inst: object) -> bool:
        with self._lock:
            return inst in self._handles

    def holder(self, inst: int) -> InstanceId:
        with self._lock:
            return self._holders[inst]

    def holders(self) -> dict[int, InstanceId]:
        with self._lock:
            return {i: self._holders[i] for i in self._handles}

    def add(self, inst: int, handle: InstanceHandle, holder: InstanceId) -> None:
        with self._lock:
            if inst in self._handles:
                raise ValueError(f"instance {inst} is already in the run")
            self._handles[inst] = handle
            self._holders[inst] = holder

    def remove(self, inst: int) -> InstanceId | None:
        """Take ``inst`` out; returns its holder id (None if it had already left)."""
        with self._lock:
            if self._handles.pop(inst, None) is None:
                return None
            return self._holders.pop(inst)

    def snapshots(self, instances: Sequence[int]) -> list[InstanceSnapshot | InstanceGone]:
        """Ask each of ``instances`` in turn (an in-process run); one that is gone
        answers with its :class:`~staleflow.runtime.interface.InstanceGone`."""
        out: list[InstanceSnapshot | InstanceGone] = []
        for i in instances:
            try:
                out.append(self[i].snapshot())
            except InstanceGone as exc:
                out.append(exc)
        return out
