"""The embedded engine's speculation state: drafts per request, their counters, the window.

What a decode step needs around its verify forward (``EmbeddedEngine._verify``): each
running request's draft, and, after the forward, the bookkeeping of what was accepted.
Kept apart from the engine so that the engine holds the batching and the forward passes.

Per-request draft method. A request may name its own method
(``GenerationRequest.draft_method``: ``group``, ``own`` or ``off``), overriding the
engine's (``SpeculationSettings.drafts.scope``); the tail race gives a copy of a straggler
another method than its original (SpecActor §4.2's fastest-of-N over draft methods,
``staleflow.runtime.controller.races``). Every method samples the same tokens for the
same key (docs/speculation.md, "The exactness argument"), so the copies stay
interchangeable and only their speed differs. Counters are kept per method.

Draft window (``SpeculationSettings.window``): :mod:`.draft_window`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from staleflow.engines.drafts import (
    GroupedDraftSource,
    SpeculationSettings,
    SpeculationStats,
)
from staleflow.engines.embedded.draft_window import DraftWindow


class Speculator:
    """Drafts, per-method counters and (optionally) the draft window of one engine."""

    def __init__(self, settings: SpeculationSettings) -> None:
        self.settings = settings
        self.source = GroupedDraftSource(settings.drafts)
        self.window = DraftWindow(settings) if settings.window else None
        self._method: dict[int, str] = {}  # running or waiting request -> its method
        # method -> [verifications (with a draft), drafted, accepted]
        self._counts: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- requests in / out

    def add(
        self,
        traj_id: int,
        group_id: int | None,
        prompt: np.ndarray,
        tokens: Sequence[int],
        method: str | None,
    ) -> None:
        """Follow a submitted request; ``method`` None: the engine's."""
        method = self.settings.drafts.scope if method is None else method
        self._method[traj_id] = method
        if method != "off":
            self.source.add(traj_id, group_id, prompt, tokens, scope=method)

    def extend(self, traj_id: int, tokens: Sequence[int]) -> None:
        self.source.extend(traj_id, tokens)

    def forget(self, traj_id: int) -> None:
        """The request left the engine (finished, interrupted, aborted): its tokens stay
        for its siblings."""
        self._method.pop(traj_id, None)
        self.source.forget(traj_id)
        if self.window is not None:
            self.window.forget(traj_id)

    def add_reference(
        self,
        group_id: int,
        prompt: np.ndarray,
        tokens: np.ndarray,
        traj_id: int | None,
        start: int,
    ) -> None:
        self.source.add_reference(group_id, prompt, tokens, traj_id, start)

    def forget_group(self, group_id: int) -> None:
        self.source.forget_group(group_id)

    @property
    def grouped(self) -> bool:
        """Some request here drafts from its group: siblings from elsewhere help."""
        return self.source.grouped

    # ----------------------------------------------------------------------- drafting

    def drafts(self, rooms: Sequence[tuple[int, int]], spare: int) -> list[list[int]]:
        """Each running request's draft: ``rooms`` gives per request (its id, the most
        tokens it may draft: one short of its budget), ``spare`` the KV budget's room
        left for the batch's drafts together. A request drafts at most the batch rule's
        length for ``len(rooms)`` running, and its window's."""
        k = self.settings.draft_length(len(rooms))
        drafts = []
        for traj_id, budget in rooms:
            room = min(k, budget, spare)
            if self.window is not None:
                room = min(room, self.window.limit(traj_id))
            off = self._method.get(traj_id) == "off"
            d = self.source.draft(traj_id, room) if room > 0 and not off else []
            spare -= len(d)
            drafts.append(d)
        return drafts

    def record(
        self, traj_ids: Iterable[int], drafts: Sequence[list[int]], kept: Sequence[Sequence[object]]
    ) -> None:
        """After a verification: request ``traj_ids[i]`` verified ``drafts[i]`` and kept
        ``kept[i]`` (its accepted draft tokens and one more sampled token)."""
        for tid, d, pairs in zip(traj_ids, drafts, kept, strict=True):
            if not d:
                continue
            took = len(pairs) - 1
            method = self._method.get(tid, self.settings.drafts.scope)
            c = self._counts.setdefault(method, [0, 0, 0])
            c[0] += 1
            c[1] += len(d)
            c[2] += took
            if self.window is not None:
                self.window.update(tid, len(d), took)

    # ----------------------------------------------------------------------- counters

    def stats(self) -> SpeculationStats:
        """All methods together."""
        return sum(self.stats_by_method().values(), SpeculationStats())

    def stats_by_method(self) -> dict[str, SpeculationStats]:
        """Per draft method (the requests' own, or the engine's), of the drafts verified."""
        return {m: SpeculationStats(*c) for m, c in sorted(self._counts.items())}
