"""The dashboard watches the runtime; the runtime never imports the dashboard (not even
lazily: ``staleflow launch`` hands it in as ``on_started``), so there is no import cycle
between the two, and importing the launcher loads no web stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _importers(package: str, target: str) -> dict[str, list[str]]:
    return {
        str(f.relative_to(ROOT)): hits
        for f in sorted((ROOT / package).rglob("*.py"))
        if (hits := sorted(m for m in imported_modules(f) if m.startswith(target)))
    }


def test_the_runtime_does_not_import_the_dashboard() -> None:
    assert _importers("staleflow/runtime", "staleflow.dashboard") == {}


def test_the_dashboard_does_not_import_the_launcher() -> None:
    # the launcher imports everything a run needs; the dashboard needs its records, its
    # live state and its actor names (staleflow.runfolder.step_record, .control, .cluster)
    assert _importers("staleflow/dashboard", "staleflow.runtime.driver.launch") == {}


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from staleflow.dashboard.app import create_app\n")
    assert imported_modules(module) == {"staleflow.dashboard.app"}


def test_importing_the_launcher_loads_no_dashboard() -> None:
    code = (
        "import sys, staleflow.runtime.driver.launch\n"
        "print(','.join(m for m in sys.modules if m.startswith('staleflow.dashboard') "
        "or m in ('fastapi', 'uvicorn')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
