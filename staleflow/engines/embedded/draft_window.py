"""A per-request draft window that follows the request's own acceptance (SpecActor §4.1).

SpecActor lets its drafter run ahead of the verifier by a window ``w`` per request and
shrinks ``w`` for the requests whose acceptance drops, so that they stop paying for drafts
that are thrown away. Our drafts are model-free and cost microseconds, so what a long draft
costs here is the verification: every draft token is a token of the verify forward. The
window is that part: on top of the batch-size rule (``SpeculationSettings.draft_length``)
each request drafts at most its own ``w``, which

* shrinks on a rejection to ``max(min_window, accepted + 1, w // 2)``: halved, but never
  below the draft prefix that was just accepted plus the token that broke it (a request
  whose drafts keep breaking early drafts one token, not ``max_draft``);
* doubles on a draft accepted whole, up to ``max_draft`` (a request whose drafts hold gets
  its long drafts back within a few steps).

A request starts at ``max_draft``. Only verified drafts move it (a step without a draft,
because the source had none or the batch rule gave none, leaves it). The window changes
how many tokens are verified, never which are sampled: the exactness argument
(docs/speculation.md) holds for a draft of any length.
"""

from __future__ import annotations

from staleflow.engines.drafts import SpeculationSettings


class DraftWindow:
    """The windows of the requests an engine runs (module docstring)."""

    def __init__(self, settings: SpeculationSettings) -> None:
        self.max = settings.max_draft
        self.min = settings.min_window
        self._w: dict[int, int] = {}
        self.shrinks = 0  # rejections that lowered a window (for the counters)

    def limit(self, traj_id: int) -> int:
        """The most draft tokens ``traj_id`` may verify next (before the batch rule)."""
        return self._w.get(traj_id, self.max)

    def update(self, traj_id: int, drafted: int, accepted: int) -> None:
        """``traj_id`` verified ``drafted`` draft tokens and ``accepted`` of them held."""
        if drafted <= 0:
            return
        w = self._w.get(traj_id, self.max)
        if accepted >= drafted:
            new = min(self.max, 2 * w)
        else:
            new = max(self.min, min(w, max(accepted + 1, w // 2)))
            self.shrinks += new < w
        self._w[traj_id] = new

    def forget(self, traj_id: int) -> None:
        self._w.pop(traj_id, None)

    def __len__(self) -> int:
        return len(self._w)
