"""Deterministic prompt sampling: a fresh permutation per epoch, fixed by (seed, epoch).

The sampler is the trajectory server's ``PromptSource``. Its position is the number of
samples drawn, so a run resumes exactly with ``start=drawn``; ``state()`` saves that
with what must not change across a resume (seed, order, epochs, dataset size), and
``from_state`` refuses a dataset or seed that would draw other prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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

    def state(self) -> dict[str, Any]:
        """The position and the settings that fix the order (plain data)."""
        return {
            "drawn": self._drawn,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "max_epochs": self._max_epochs,
            "dataset_size": len(self._dataset),
        }

    @classmethod
    def from_state(cls, dataset: Sequence[Sample], state: Mapping[str, Any]) -> PromptSampler:
        """A sampler at the saved position, over ``dataset`` (which must be the saved one's
        size: another dataset would draw other prompts after the resume)."""
        try:
            drawn, size = state["drawn"], state["dataset_size"]
            seed, shuffle, max_epochs = state["seed"], state["shuffle"], state["max_epochs"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a sampler state needs the field {exc} (from state())") from None
        if size != len(dataset):
            raise ValueError(
                f"dataset_size: the run sampled from {size} prompts, this dataset has "
                f"{len(dataset)}; resume with the run's own dataset"
            )
        if isinstance(drawn, bool) or not isinstance(drawn, int):
            raise ValueError(f"drawn: must be an int, got {drawn!r}")
        return cls(dataset, seed=seed, shuffle=shuffle, max_epochs=max_epochs, start=drawn)

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
