"""Converters from the trainer's parameter layout to the rollout engine's (App. A.1, step 2).

* :class:`IdentityConverter`: the embedded PyTorch trainer already uses the
  Hugging Face names the rollout engine loads.
* :class:`MegatronToHF` (in :mod:`parameter_server.convert_megatron`):
  Megatron-core tensor-parallel shards of a Llama/Qwen-style GPT gathered into
  Hugging Face names.

Converters write straight into the views of a target buffer
(``convert_into``), so a Push can convert into a PS slot without an extra copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from parameter_server.convert_megatron import GPTConfig, MegatronToHF
from parameter_server.layout import Layout


class Converter(Protocol):
    """Maps the trainer's exported weights onto the rollout layout."""

    @property
    def target_layout(self) -> Layout: ...

    def convert_into(self, source: Any, out: Mapping[str, np.ndarray]) -> None:
        """Write the converted weights into ``out`` (views of a target buffer)."""
        ...


class IdentityConverter:
    """Trainer names == rollout names; only validates."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    @property
    def target_layout(self) -> Layout:
        return self._layout

    def convert(self, source: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        self._layout.validate(source)
        return source

    def convert_into(self, source: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None:
        self._layout.validate(source)
        for name, view in out.items():
            np.copyto(view, source[name].view(view.dtype), casting="no")


__all__ = ["Converter", "GPTConfig", "IdentityConverter", "MegatronToHF"]
