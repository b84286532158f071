"""The layout rules of docs/architecture.md, checked on src/darkbloom (run by `make test`):

- no import cycle between modules, not even through imports under ``if TYPE_CHECKING:``;
- the coordinator and the provider never import each other (both import ``darkbloom.wire``);
- no module below the HTTP edge (``darkbloom.coordinator.http``) imports it; only the app factory
  mounts it;
- production code reads no ``DARKBLOOM_TEST_*`` variable (test hooks live under tests/);
- every module (``__init__.py`` and migrations aside) has its line in the source tree that opens
  docs/architecture.md, and every ``.py`` that tree names exists.

Size follows the idea: a module past WARN_LINES lines is reported as a warning (is it still one
idea?), never a failure.

The tree is the first fenced code block of docs/architecture.md. Each line is one entry, indented
two spaces per level under the folder it belongs to (a name ending in ``/``), then a ``#`` and what
the entry is for; a line that starts with ``#`` after its indent continues the description above.
The root entry is ``src/darkbloom/``, so ``lifecycle.py`` indented six spaces, below
``    inference/`` below ``  coordinator/``, names src/darkbloom/coordinator/inference/lifecycle.py.
Adding a module means adding its line there (with its one job); renaming or deleting one means
changing or removing its line.

Exit status 1 with one line per problem; warnings are printed too and leave the status 0.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "darkbloom"
WARN_LINES = 600
SEPARATE = ("darkbloom.coordinator", "darkbloom.provider")
EDGE = "darkbloom.coordinator.http"
EDGE_MOUNTS = frozenset({"darkbloom.coordinator.app"})  # the app factory, the one module that mounts the edge
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"
TREE_INDENT = 2



def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path, modules: set[str], type_checking: bool = False) -> set[str]:
    """The modules of ``modules`` that ``path`` imports; those under ``if TYPE_CHECKING:`` only
    when ``type_checking``."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if not type_checking and _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules and name != this}


def import_graph(paths: list[Path], modules: set[str], type_checking: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = module_name(path)
        # a package's import of its own submodules (re-exports in __init__) is not a dependency back
        graph[name] = {m for m in imports(path, modules, type_checking)
                       if not (path.name == "__init__.py" and m.startswith(name + "."))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def documented_tree(text: str) -> tuple[dict[str, str], list[str]]:
    """The entries of the first fenced block of ``text`` (path from the repository root → its
    description), and the problems found reading it."""
    lines = text.splitlines()
    fences = [number for number, line in enumerate(lines) if line.lstrip().startswith("```")]
    if len(fences) < 2:
        return {}, ["docs/architecture.md: no source tree (it must open with a fenced block of src/darkbloom/)"]
    entries: dict[str, str] = {}
    problems: list[str] = []
    folders: list[str] = []  # folders[d] is the path of the open folder at depth d
    for number in range(fences[0] + 1, fences[1]):
        line = lines[number].rstrip()
        body = line.lstrip(" ")
        if not body or body.startswith("#"):
            continue  # blank, or the description above continues
        indent = len(line) - len(body)
        where = f"docs/architecture.md:{number + 1}"
        if indent % TREE_INDENT or indent // TREE_INDENT > len(folders):
            problems.append(f"{where}: '{body.split()[0]}' is not indented {TREE_INDENT} spaces under a folder")
            continue
        depth = indent // TREE_INDENT
        name, _, description = body.partition(" ")
        path = (folders[depth - 1] if depth else "") + name
        del folders[depth:]
        if name.endswith("/"):
            folders.append(path)
        entries[path] = description.strip().removeprefix("#").strip()
    return entries, problems


def tree_problems(paths: list[Path], text: str) -> list[str]:
    """Every module has a described line in the tree; every .py the tree names exists."""
    entries, problems = documented_tree(text)
    repository = ROOT.parent
    for path in paths:
        name = path.relative_to(repository).as_posix()
        if path.name == "__init__.py":
            continue
        if name not in entries:
            problems.append(f"{path.relative_to(ROOT)}: no line in the tree of docs/architecture.md "
                            "(add one saying its one job)")
        elif not entries[name]:
            problems.append(f"{path.relative_to(ROOT)}: its line in docs/architecture.md says nothing "
                            "(add '# its one job')")
    for name in sorted(entries):
        if name.endswith(".py") and not (repository / name).is_file():
            problems.append(f"docs/architecture.md names {name}, which does not exist (update the tree)")
    return problems


def cycle_path(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component, as the modules
    in import order with the first one repeated at the end."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & members):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    return component


def _cycle_line(component: list[str], graph: dict[str, set[str]], runtime: dict[str, set[str]]) -> str:
    path = cycle_path(component, graph)
    steps = [path[0]]
    for source, target in zip(path, path[1:]):
        steps.append(target if target in runtime[source] else f"{target} (under TYPE_CHECKING)")
    return " → ".join(steps)


def in_edge(name: str) -> bool:
    return name == EDGE or name.startswith(EDGE + ".")


def check(paths: list[Path], architecture: str) -> tuple[list[str], list[str]]:
    """The problems (each fails the check) and the warnings of the modules at ``paths``."""
    modules = {module_name(p) for p in paths}
    runtime = import_graph(paths, modules, type_checking=False)
    every = import_graph(paths, modules, type_checking=True)
    problems: list[str] = []
    warnings: list[str] = []
    for path in paths:
        name, text = module_name(path), path.read_text()
        where = path.relative_to(ROOT)
        lines = len(text.splitlines())
        if lines > WARN_LINES:
            warnings.append(f"{where}: {lines} lines (over {WARN_LINES}: is it still one idea?)")
        if "DARKBLOOM_TEST_" in text:
            problems.append(f"{where}: reads a DARKBLOOM_TEST_* variable (test hooks live in tests/)")
        for mine, theirs in (SEPARATE, SEPARATE[::-1]):
            if name.startswith(mine):
                for target in sorted(every[name]):
                    if target.startswith(theirs):
                        problems.append(f"{name} imports {target}: {mine} and {theirs} never import each other")
        if not in_edge(name) and name not in EDGE_MOUNTS:
            for target in sorted(t for t in every[name] if in_edge(t)):
                problems.append(f"{name} imports {target}: the layers below the HTTP edge never import it "
                              "(move what they share out of http/)")
    runtime_cycles = cycles(runtime)
    for component in runtime_cycles:
        problems.append("import cycle: " + _cycle_line(component, runtime, runtime))
    for component in cycles(every):
        if not any(set(c) <= set(component) for c in runtime_cycles):
            problems.append("import cycle: " + _cycle_line(component, every, runtime))
    problems += tree_problems(paths, architecture)
    return problems, warnings


def main() -> int:
    paths = sorted(p for p in (ROOT / PACKAGE).rglob("*.py") if "migrations" not in p.parts)
    problems, warnings = check(paths, ARCHITECTURE.read_text() if ARCHITECTURE.is_file() else "")
    for problem in problems:
        print(problem)
    for warning in warnings:
        print("warning: " + warning)
    if not problems:
        print(f"layout ok: {len(paths)} modules, no import cycle, each in the tree of docs/architecture.md"
              + (f" ({len(warnings)} warnings above)" if warnings else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
