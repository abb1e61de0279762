"""Fixtures for the trajectory server tests.

Fakes one edge only: the prompt source (a fixed cycle of tiny prompts instead of a
dataset). The server under test is the real one; :func:`in_process_client` puts the real
client in front of the real bytes service without Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from trajectory_server import TrajectoryServer, TrajectoryServerConfig
from trajectory_server.actor import TrajectoryServerClient, TrajectoryServerService


@dataclass(frozen=True)
class FakeSample:
    sample_id: int
    prompt_ids: np.ndarray
    answer: str


class CycleSource:
    """Prompt ``i`` has ``2 + i % 3`` tokens; stops after ``limit`` samples if given."""

    def __init__(self, limit: int | None = None) -> None:
        self.drawn = 0
        self.limit = limit

    def next_sample(self) -> FakeSample | None:
        if self.limit is not None and self.drawn >= self.limit:
            return None
        i = self.drawn
        self.drawn += 1
        return FakeSample(i, np.arange(2 + i % 3, dtype=np.int32) + 10, str(i))


def _response(n: int, version: int, start: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` generated tokens, all by policy ``version``."""
    tokens = np.arange(start, start + n, dtype=np.int32) % 97 + 3
    return tokens, np.full(n, -0.5, dtype=np.float32), np.full(n, version, dtype=np.int32)


def _make_ts(**overrides: object) -> TrajectoryServer:
    config = {"eta": 1, "batch_size": 2, "group_size": 2} | overrides
    limit = config.pop("limit", None)
    return TrajectoryServer(TrajectoryServerConfig(**config), CycleSource(limit))  # type: ignore[arg-type]


@pytest.fixture
def make_ts() -> Callable[..., TrajectoryServer]:
    """Factory: ``make_ts(eta=..., limit=...)``; defaults eta=1, batch 2, group 2."""
    return _make_ts


@pytest.fixture
def response() -> Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``response(n, version, start=0)``: arrays of ``n`` generated tokens."""
    return _response


@pytest.fixture
def ts() -> TrajectoryServer:
    """eta=1, batch 2, group 2: capacity 4 groups = 8 trajectories, ids 0..7."""
    return _make_ts()


class _InProcessHandle:
    """What ``ray.remote`` makes of the service, called in this process."""

    def __init__(self, service: TrajectoryServerService) -> None:
        self._service = service

    def __getattr__(self, method: str) -> Any:
        return SimpleNamespace(remote=getattr(self._service, method))


def in_process_client(service: TrajectoryServerService) -> TrajectoryServerClient:
    """The client over ``service``: every call packs, crosses as bytes, unpacks; no Ray."""
    client = TrajectoryServerClient.__new__(TrajectoryServerClient)  # its __init__ imports ray
    client._ray = SimpleNamespace(get=lambda value: value)  # type: ignore[assignment]
    client.handle = _InProcessHandle(service)
    return client
