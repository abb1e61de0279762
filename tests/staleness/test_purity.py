"""``staleness`` is pure Python (DESIGN.md, "Decisions are pure"): no module of it imports
a framework, at the top or inside a function, and importing all of it loads none."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import staleness

FORBIDDEN = (
    "ray",
    "torch",
    "fastapi",
    "uvicorn",
    "sglang",
    "vllm",
    "megatron",
    "nixl",
    "transformers",
)
PACKAGE = Path(staleness.__file__).resolve().parent


def forbidden_imports(source: str) -> list[str]:
    """Top-level names of the forbidden packages that ``source`` imports, anywhere."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in FORBIDDEN]
    return found


def test_no_module_of_staleness_imports_a_framework() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 3  # the package was found
    bad = {
        str(f.relative_to(PACKAGE.parent)): found
        for f in files
        if (found := forbidden_imports(f.read_text(encoding="utf-8")))
    }
    assert bad == {}


def test_importing_all_of_staleness_loads_no_framework() -> None:
    modules = [m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="staleness.")]
    code = (
        "import importlib, sys\n"
        f"for m in {['staleness', *modules]!r}: importlib.import_module(m)\n"
        f"print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_check_sees_lazy_and_dotted_imports() -> None:
    source = (
        "import numpy\n"
        "def f():\n"
        "    import torch.nn as nn\n"
        "    from ray.util import list_named_actors\n"
        "    from .types import X\n"
    )
    assert forbidden_imports(source) == ["torch.nn", "ray.util"]
