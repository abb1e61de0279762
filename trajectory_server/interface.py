"""What the trajectory server needs from the outside (contracts only, no logic).

The TS draws prompts from a :class:`PromptSource`; ``staleflow.data.PromptSampler`` is
the standard one. Invariants the server keeps, for its callers:

- every trajectory id it ever created is in exactly one of QUEUED, ROUTED, COMPLETED, or
  was consumed (``take_batch``) or aborted exactly once; ids are never reused;
- the routing view lists exactly the QUEUED trajectories, smaller ``V_traj`` first,
  initial ones last, first-in first-out within a level;
- a trajectory's ``V_traj`` never changes once set, and every per-token version of its
  response is ``>= V_traj``;
- a call that raises a ``TrajectoryServerError`` changed nothing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class SampleLike(Protocol):
    """One dataset row, tokenised."""

    @property
    def sample_id(self) -> int: ...

    @property
    def prompt_ids(self) -> np.ndarray:
        """1-D int32 prompt tokens."""
        ...

    @property
    def answer(self) -> str:
        """Ground truth for the reward."""
        ...


@runtime_checkable
class PromptSource(Protocol):
    def next_sample(self) -> SampleLike | None:
        """The next prompt, or None when the source is exhausted for good."""
        ...


@runtime_checkable
class ResumableSource(PromptSource, Protocol):
    """A source whose position can be saved: the TS saves ``state()`` with its own state
    (at the same instant), and a restored TS checks that its source is at that position."""

    def state(self) -> dict[str, int | bool | None]:
        """Plain data that identifies the position (e.g. samples drawn, seed)."""
        ...
