"""Load a script of ``experiments/`` as a module, so tests call its ``main`` in process.

The scripts are not a package (each runs as ``python experiments/NAME.py``), so tests
import them from their file. The module is registered under its name before it runs:
a dataclass defined in a script looks its module up in ``sys.modules``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load(name: str) -> ModuleType:
    """``experiments/<name>.py`` as a freshly executed module."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no experiments/{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
