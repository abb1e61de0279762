"""Messages that name a missing piece say the exact command that adds it, and every
install command written in the code and docs names an extra that exists."""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from staleflow.install import install_command, missing

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_installs_into_this_interpreter_with_the_checkouts_constraints():
    words = shlex.split(install_command())
    assert words[:4] == [sys.executable, "-m", "pip", "install"]
    assert words[4:] == ["-c", str(ROOT / "constraints.txt"), "-e", str(ROOT)]
    assert shlex.split(install_command("nixl"))[-1] == f"{ROOT}[nixl]"


def test_a_missing_piece_names_where_it_comes_from_and_the_command():
    text = missing("ray (to attach to a live run)", ImportError("No module named 'ray'"))
    assert text.startswith("ray (to attach to a live run) is missing (No module named 'ray')")
    assert "the default install" in text and text.endswith(install_command())
    assert missing("NIXL", extra="nixl").endswith(install_command("nixl"))


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _texts() -> list[Path]:
    code = [
        p
        for top in (
            "staleflow",
            "staleness",
            "trajectory_server",
            "parameter_server",
            "coordinator",
        )
        for p in (ROOT / top).rglob("*.py")
    ]
    docs = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "deploy").rglob("*.*")]
    scripts = [*(ROOT / "scripts").glob("*"), ROOT / ".ci" / "run"]
    return [*code, *docs, *(ROOT / "experiments").glob("*.py"), *scripts]


@pytest.mark.parametrize("path", _texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_extra_named_in_an_install_command_exists(path):
    # `pip install ... staleflow[x,y]` or `-e '.[x]'`: a renamed or merged extra would
    # leave a command that installs nothing (pip only warns about an unknown extra)
    extras = _extras()
    for match in re.finditer(r"(?:staleflow|\.)\[([a-z0-9_,-]+)\]", path.read_text()):
        named = set(match.group(1).split(","))
        assert named <= extras, f"{path.name}: {match.group(0)} names {named - extras}"
