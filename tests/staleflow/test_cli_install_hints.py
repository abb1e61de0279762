"""Every install hint the launcher prints is a command that runs as printed, naming its
extra. The launcher's console (rich) used to read ``[megatron]`` in
``pip install -e '/path[megatron]'`` as a style tag and drop it: the printed command
installed nothing. The hints are found in the library's source (every string literal
with "pip install", and ``install_command`` for every extra of pyproject.toml) and each
is rendered through the launcher's own printing path (``staleflow.commands.printing.print_text``).
No Ray: ``ray.init`` fails the test if the launcher reaches it."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tomllib
from pathlib import Path

import pytest
from rich.console import Console

from staleflow.cli import main
from staleflow.commands.printing import print_text
from staleflow.install import install_command, missing

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("staleflow", "parameter_server", "trajectory_server", "coordinator", "staleness")


def _squeezed(text: str) -> str:
    return "".join(text.split())  # the console wraps long lines at spaces


def _rendered(text: str, **kwargs) -> str:
    out = io.StringIO()
    print_text(Console(file=out, width=100, color_system=None), text, **kwargs)
    return out.getvalue()


def _literal_hints() -> list[str]:
    hints = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
                if literal and "pip install" in node.value:
                    hints.append(node.value)
    return hints


EXTRAS = sorted(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)


def test_the_library_has_install_hints_to_check():
    assert len(_literal_hints()) >= 5 and "megatron" in EXTRAS


@pytest.mark.parametrize("hint", _literal_hints())
def test_every_literal_install_hint_is_printed_verbatim(hint):
    printed = _rendered(hint, label="staleflow launch failed:", style="red")
    assert _squeezed(hint) in _squeezed(printed)


@pytest.mark.parametrize("extra", EXTRAS)
def test_the_hint_for_every_extra_prints_a_command_naming_it(extra):
    message = missing("a piece", extra=extra)
    printed = _squeezed(_rendered(message, label="staleflow launch failed:", style="red"))
    command = install_command(extra)
    assert _squeezed(command) in printed
    assert re.search(rf"pipinstall.*\[{re.escape(extra)}\]", printed)


def test_the_launcher_prints_the_megatron_hint_with_its_extra(monkeypatch, capsys):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("the missing megatron-core should stop the launch before Ray")

    monkeypatch.setattr(ray, "init", refuse)
    find_spec = importlib.util.find_spec

    def without_megatron(name, *args, **kwargs):
        if name == "megatron" or name.startswith("megatron."):
            return None
        return find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_megatron)
    code = main(["launch", "--no-dashboard", "--no-live", "trainer.backend=megatron"])
    out = capsys.readouterr()
    printed = _squeezed(out.out + out.err)
    assert code != 0
    assert _squeezed(install_command("megatron")) in printed, out
    assert "[megatron]" in printed
