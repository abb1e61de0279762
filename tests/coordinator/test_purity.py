"""``coordinator`` is pure Python: importing it pulls in no framework (DESIGN.md)."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("ray", "torch", "fastapi", "sglang", "megatron", "nixl", "transformers")


def test_importing_the_coordinator_imports_no_framework() -> None:
    code = (
        "import sys, coordinator, coordinator.executor, coordinator.profiler\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
