"""A run folder's files are named in staleflow/runfolder/ only (STYLE.md rule 15), and
:class:`RunLayout` reads back the ``live.json`` it writes.

A spelling is a string that is a file name or a path ending in one (``folder /
"metrics.jsonl"``, ``f"{folder}/metrics.jsonl"``): code that finds a file. Messages and
help texts may name a file for the reader."""

from __future__ import annotations

import ast
from pathlib import Path

from staleflow.runfolder.layout import FILES, LIVE, RunLayout

LIBRARY = Path(__file__).resolve().parents[3] / "staleflow"
OWNER = LIBRARY / "runfolder"


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(id(value))
    return found


def _spellings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    return [
        f"{path.relative_to(LIBRARY.parent)}:{node.lineno} spells {name!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        for name in FILES
        if node.value == name or node.value.endswith(f"/{name}")
    ]


def test_the_walk_finds_a_spelling() -> None:
    # the test can fail: the owner itself spells every name
    assert {s.rsplit(" ", 1)[-1] for s in _spellings(OWNER / "layout.py")} >= {
        repr(n) for n in FILES
    }


def test_no_file_name_of_a_run_folder_is_spelled_outside_staleflow_runfolder() -> None:
    wrong = [
        s
        for path in sorted(LIBRARY.rglob("*.py"))
        if OWNER not in path.parents
        for s in _spellings(path)
    ]
    assert not wrong, "name these through staleflow.runfolder.layout:\n" + "\n".join(wrong)


def test_live_json_reads_back_what_was_written_and_goes(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    assert not layout.looks_like_a_run()
    layout.write_live({"run": "r", "driver_pid": 7})
    assert layout.read_live() == {"run": "r", "driver_pid": 7}
    assert [p.name for p in tmp_path.iterdir()] == [LIVE]  # no temporary file left
    layout.remove_live()
    assert not layout.live.exists()
