"""Deterministic prompt sampling: a fresh permutation per epoch, fixed by (seed, epoch).

The sampler is the trajectory server's ``PromptSource``. Its whole state is the number of
samples drawn, so a run resumes exactly with ``start=drawn``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from staleflow.data.datasets import Sample


class PromptSampler:
    def __init__(
        self,
        dataset: Sequence[Sample],
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int | None = None,
        start: int = 0,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty dataset")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs={max_epochs}; use at least 1, or None for no limit")
        if start < 0:
            raise ValueError(f"start={start} is negative")
        self._dataset = dataset
        self._seed = seed
        self._shuffle = shuffle
        self._max_epochs = max_epochs
        self._drawn = start
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    @property
    def drawn(self) -> int:
        """Samples drawn so far (including ``start``)."""
        return self._drawn

    @property
    def epoch(self) -> int:
        return self._drawn // len(self._dataset)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset indices of one epoch, in the order they are drawn."""
        n = len(self._dataset)
        if not self._shuffle:
            return np.arange(n)
        return np.random.default_rng([self._seed, epoch]).permutation(n)

    def next_sample(self) -> Sample | None:
        epoch, position = divmod(self._drawn, len(self._dataset))
        if self._max_epochs is not None and epoch >= self._max_epochs:
            return None
        if epoch != self._order_epoch:
            self._order, self._order_epoch = self.order(epoch), epoch
        self._drawn += 1
        return self._dataset[int(self._order[position])]
