"""Moving policy weights through the parameter server: Pull into an engine, Push from a
trainer. Names and shapes are those of the model's ``named_parameters()`` (the unified
representation of the embedded backends, App. A.1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from parameter_server import Layout


class PullSource(Protocol):
    """Where an instance gets weights: ``fetch(at_least)`` -> (version, name -> array);
    with LoRA adapters (``trainer.lora``) a version is the adapter, and ``fetch_base()`` the
    frozen base under it, once."""

    def fetch(self, at_least: int) -> tuple[int, Mapping[str, np.ndarray]]: ...

    def fetch_base(self) -> Mapping[str, np.ndarray]: ...


class TransportPullSource:
    """Pulls the latest version from a PS worker into one reusable buffer.

    The views it returns alias that buffer, so the caller must have copied them (loaded
    them into the engine) before the next ``fetch``.
    """

    def __init__(self, transport: object, layout: Layout) -> None:
        self._transport = transport
        self._layout = layout
        self._buffer = np.empty(layout.nbytes, dtype=np.uint8)

    def fetch(self, at_least: int) -> tuple[int, Mapping[str, np.ndarray]]:
        version = self._transport.pull(self._buffer)  # type: ignore[attr-defined]
        _check_at_least(version, at_least)
        return version, self._layout.views(self._buffer)

    def fetch_base(self) -> Mapping[str, np.ndarray]:
        """The base of adapter versions, into a buffer of its own (it moves once)."""
        base = self._transport.base_layout  # type: ignore[attr-defined]
        buffer = np.empty(base.nbytes, dtype=np.uint8)
        self._transport.pull_base(buffer)  # type: ignore[attr-defined]
        return base.views(buffer)

    def latest_version(self, at_least: int) -> int:
        """The newest version the PS holds, for engines that pull it themselves."""
        latest = self._transport.info().latest  # type: ignore[attr-defined]
        version = -1 if latest is None else int(latest)
        _check_at_least(version, at_least)
        return version


def _check_at_least(version: int, at_least: int) -> None:
    if version < at_least:
        raise RuntimeError(
            f"the parameter server's latest version is {version}, but version {at_least} "
            "or newer was asked for: the PS lost a Push or was restarted"
        )
