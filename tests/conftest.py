"""Skip marked tests cleanly where what they need is absent; keep torch on one thread; on
pytest-xdist's workers, keep the tests that start process trees one at a time."""

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
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))


# Files whose tests start Ray without the ``ray`` marker, or spawn process groups of
# their own (Megatron's gloo ranks, SGLang stand-in servers).
RAY_FILES = ("runtime/driver/test_launch_checks.py",)
SPAWN_FILES = ("trainers/test_megatron", "engines/test_sglang_adapter")


def _xdist_group(item: pytest.Item) -> str:
    """scripts/check runs the suite on two xdist workers (``--dist loadgroup``), one a
    core. Tests that start Ray all run on one worker, one after another, and so do those
    that spawn process groups: two local Rays at once on two cores can miss Ray's fixed
    30 s start-up wait. Every other test goes with its file, so a module's fixtures are
    built once."""
    path = item.nodeid.split("::", 1)[0]
    if item.get_closest_marker("ray") or path.endswith(RAY_FILES):
        return "ray"
    if item.get_closest_marker("heavy") or any(part in path for part in SPAWN_FILES):
        return "spawn"
    return path


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
