"""The project's own imports form no cycle, and the layers point one way.

Walks every module of ``staleflow/``, ``staleness/``, ``coordinator/``,
``trajectory_server/`` and ``parameter_server/`` with :mod:`ast` (nothing is imported) and
collects each ``import`` / ``from ... import`` of a project module: at module level, in
functions, and under ``if TYPE_CHECKING:`` (a type-only import is still a dependency a
reader follows, and a circle of them is a circle of the design).

How an import becomes an arrow:

- ``import a.b.c`` and ``from a.b.c import x`` point at the deepest module that exists
  (``a.b.c``; ``a.b.c.x`` when ``x`` is itself a submodule); relative imports are resolved
  first.
- The parent packages Python runs on the way (``a/__init__``, ``a/b/__init__``) are not
  arrows. So a package whose ``__init__`` re-exports its submodules (``from a.b import
  x`` inside ``a/__init__``, an arrow ``a -> a.b``) forms no cycle with them; only a
  submodule that imports its own package's ``__init__`` (``from a import y`` inside
  ``a/b.py``) closes one, and that one counts: it is the partial-import trap.

What must hold:

- no cycle among the project's modules (the test names one cycle of each strongly
  connected group);
- ``staleflow/sim/`` imports nothing from ``staleflow.runtime`` (the simulator stands
  beside the runtime, on the shared control loop, the pure core and ``staleflow.runfolder``);
- ``staleness/``, ``coordinator/``, ``trajectory_server/`` and ``parameter_server/`` import
  nothing from ``staleflow``;
- function-level imports of the project's own modules stay at most
  :data:`FUNCTION_LEVEL_CEILING`, and each says why it waits in a ``# `` comment on its
  line or just above it (above the group of imports it opens). A lazy import hides a
  cycle or a heavy dependency from the reader; lower the ceiling when one goes, never
  raise it without a reason. (Lazy imports of ray, torch, vllm, sglang, megatron are not
  counted: they are not the project's.)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("staleflow", "staleness", "coordinator", "trajectory_server", "parameter_server")
PURE = ("staleness", "coordinator", "trajectory_server", "parameter_server")
FUNCTION_LEVEL_CEILING = 15  # #33 asks for <= 25; 185 before the runtime was regrouped, 158 after


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module it points at
    line: int
    in_function: bool


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _deepest(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        if name.split(".")[0] in PACKAGES and (target := _deepest(name)) and target != module:
            found.append(target)
    return list(dict.fromkeys(found))


def _imports(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: list[Import] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.extend(
                    Import(module, target, child.lineno, in_function)
                    for target in _targets(child, module, is_package)
                )
            walk(child, inner)

    walk(tree, False)
    return out


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports(module, path)]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the groups of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def _a_cycle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the group's first module (breadth-first, the shortest)."""
    start, members = group[0], set(group)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return group


def _where(source: str, target: str) -> str:
    line = min(i.line for i in IMPORTS if i.source == source and i.target == target)
    return f"{MODULES[source].relative_to(ROOT)}:{line}"


def test_the_walk_sees_the_imports():
    # the test can fail: the walk finds the arrows it is meant to check
    assert len(MODULES) > 200
    arrows = {(i.source, i.target) for i in IMPORTS}
    assert ("staleflow.runtime.driver.launch", "staleflow.runtime.driver.run") in arrows
    assert any(i.in_function for i in IMPORTS)


def test_no_import_cycle_among_the_projects_modules():
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        graph[module]
    for imp in IMPORTS:
        graph[imp.source].add(imp.target)
    cycles = []
    for group in _strongly_connected(graph):
        cycle = _a_cycle(group, graph)
        steps = [f"{a} -> {b} ({_where(a, b)})" for a, b in pairwise(cycle)]
        cycles.append(f"{len(group)} modules, e.g.:\n  " + "\n  ".join(steps))
    assert not cycles, "import cycles among the project's modules:\n" + "\n".join(cycles)


def test_the_simulator_imports_nothing_from_the_runtime():
    wrong = [
        f"{MODULES[i.source].relative_to(ROOT)}:{i.line} imports {i.target}"
        for i in IMPORTS
        if i.source.startswith("staleflow.sim") and i.target.startswith("staleflow.runtime")
    ]
    assert not wrong, "staleflow/sim/ must not import the runtime:\n" + "\n".join(wrong)


def test_the_pure_core_imports_nothing_from_staleflow():
    wrong = [
        f"{MODULES[i.source].relative_to(ROOT)}:{i.line} imports {i.target}"
        for i in IMPORTS
        if i.source.split(".")[0] in PURE and i.target.split(".")[0] == "staleflow"
    ]
    assert not wrong, "the core packages must not import staleflow:\n" + "\n".join(wrong)


def test_function_level_imports_of_the_projects_modules_stay_few():
    statements = sorted({(i.source, i.line) for i in IMPORTS if i.in_function})
    listing = "\n".join(f"  {MODULES[m].relative_to(ROOT)}:{line}" for m, line in statements)
    assert len(statements) <= FUNCTION_LEVEL_CEILING, (
        f"{len(statements)} function-level imports of the project's own modules, more than "
        f"{FUNCTION_LEVEL_CEILING}: import at module level, or say at the import why it "
        f"must wait (a cycle to break is not a reason):\n{listing}"
    )


def _commented(path: Path, line: int) -> bool:
    """A ``# `` comment on the import's line, or on the line above the run of import
    lines it belongs to (one comment may explain a group of lazy imports)."""
    lines = path.read_text().splitlines()
    if "# " in lines[line - 1]:
        return True
    above = line - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("# ")


def test_each_function_level_import_of_the_projects_modules_says_why():
    silent = sorted(
        f"  {MODULES[m].relative_to(ROOT)}:{line}"
        for m, line in {(i.source, i.line) for i in IMPORTS if i.in_function}
        if not _commented(MODULES[m], line)
    )
    assert not silent, (
        "function-level imports of the project's own modules without a `# ` comment saying "
        "why they wait (torch, an optional extra, ...):\n" + "\n".join(silent)
    )
