"""Skip marked tests cleanly where what they need is absent; keep torch on one thread."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {}
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda():
        reasons["gpu"] = "needs a CUDA GPU"
    if importlib.util.find_spec("ray") is None:
        reasons["ray"] = "needs ray (default install: pip install -c constraints.txt -e .)"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        reasons["browser"] = "needs Debian's chromium: apt-get install chromium"
    for item in items:
        for marker, reason in reasons.items():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One torch thread per test: the tensors are tiny, and on a shared machine a second
    thread mostly spins waiting for a core (measured: 9x slower under load). Only where
    the test module already imported torch, so other tests do not pay for the import."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
