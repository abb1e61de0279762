"""Errors of ``staleflow launch`` (plain Python: the pure placement code raises them too)."""

from __future__ import annotations

from collections.abc import Iterable


class LaunchError(RuntimeError):
    """The run could not start or stopped early; the message says which part and why."""


class PlacementError(LaunchError):
    """The cluster cannot hold the plan; ``missing`` says what is lacking, one line each."""

    def __init__(self, missing: Iterable[str]) -> None:
        self.missing = tuple(missing)
        super().__init__(
            "the cluster cannot hold this placement: "
            + "; ".join(self.missing)
            + " (add nodes, or lower the resources.* asks: docs/cluster.md)"
        )
