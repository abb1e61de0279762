"""Grouped drafts across instances: the TS is the draft server (docs/speculation.md).

An engine with grouped speculative decoding drafts each trajectory's next tokens from the
responses of its group. Members that run on this instance it sees itself; the others run
elsewhere, and the TS holds their responses (every instance reports its partial responses
every ``rollout.progress_every_s``, and finished ones at once). :class:`SiblingDrafts`
fetches, for the groups of the trajectories here, the members' tokens past what this
engine was handed already (the TS leaves out those ROUTED here), and hands them to the
engine (``add_group_responses``, by member and start index, so each member's pieces join
up). The same call tells which of the groups this engine has seen left the TS (consumed,
aborted or filtered): the engine forgets them (``forget_groups``).

Cost per fetch: one TS call carrying ``{group: {member: length}}`` for the groups running
here (a few integers per member) and the ids of groups seen before; the reply carries only
new tokens (int32, packed), so every token of a sibling crosses to an instance at most
once. The engine indexes them lazily, when one of the group's members drafts.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from staleflow.rollout.instance import RolloutInstance
from trajectory_server.types import InstanceId, SiblingResponses, SiblingTokens

logger = logging.getLogger(__name__)


class SiblingServer(Protocol):
    """The part of the TS that serves siblings' responses."""

    def group_responses(
        self,
        known: Mapping[int, Mapping[int, int]],
        instance_id: InstanceId | None = None,
        watch: Iterable[int] = (),
    ) -> SiblingResponses: ...


class DraftsFromSiblings(Protocol):
    """What the feed calls of the engine (the embedded engine's grouped speculation)."""

    def add_group_responses(
        self,
        group_id: int,
        prompt: np.ndarray,
        responses: Iterable[np.ndarray],
        traj_ids: Sequence[int] | None = None,
        starts: Sequence[int] | None = None,
    ) -> None: ...

    def forget_groups(self, group_ids: Iterable[int]) -> None: ...


class SiblingDrafts:
    """What one instance's engine has of its groups' members from elsewhere."""

    def __init__(self, instance: RolloutInstance, ts: SiblingServer, holder: InstanceId) -> None:
        self._instance = instance
        self._ts = ts
        self._holder = holder
        # group -> member -> response tokens handed to the engine; every group the engine
        # has seen is here until the TS says it is gone
        self._have: dict[int, dict[int, int]] = {}
        self.fetches = 0
        self.tokens = 0  # sibling tokens handed to the engine

    def fetch(self) -> int:
        """Hand the engine what is new of its running groups' members elsewhere, and have it
        forget the groups gone from the TS; returns the tokens handed over."""
        prompts, here = self._instance.between_steps(_groups_here)
        for g in prompts:
            self._have.setdefault(g, {})
        known = {g: dict(self._have[g]) for g in prompts}
        watch = [g for g in self._have if g not in prompts]
        reply = self._ts.group_responses(known, self._holder, watch)
        by_group: dict[int, list[SiblingTokens]] = defaultdict(list)
        for r in reply.responses:
            # a race copy runs here of a member held elsewhere: the engine has it already
            if r.group_id in prompts and r.traj_id not in here:
                by_group[r.group_id].append(r)

        def feed(engine: DraftsFromSiblings, _: object) -> None:
            for g, pieces in by_group.items():
                engine.add_group_responses(
                    g,
                    prompts[g],
                    [p.tokens for p in pieces],
                    [p.traj_id for p in pieces],
                    [p.start for p in pieces],
                )
            if reply.gone:
                engine.forget_groups(reply.gone)

        self._instance.between_steps(feed)
        sent = 0
        for pieces in by_group.values():
            for p in pieces:
                self._have[p.group_id][p.traj_id] = p.start + len(p.tokens)
                sent += len(p.tokens)
        for g in reply.gone:
            self._have.pop(g, None)
        self.fetches += 1
        self.tokens += sent
        return sent

    @property
    def groups(self) -> int:
        """Groups the engine has seen and the TS still holds, as far as known here."""
        return len(self._have)


def _groups_here(
    _: object, held: dict[int, tuple[int, np.ndarray]]
) -> tuple[dict[int, np.ndarray], set[int]]:
    """The groups of the trajectories here with their prompts, and those trajectories."""
    return {group: prompt for group, prompt in held.values()}, set(held)
