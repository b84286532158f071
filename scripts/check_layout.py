"""The layout rules of docs/architecture.md, checked on src/darkbloom (run by `make test`):

- no import cycle between modules (imports under ``if TYPE_CHECKING:`` do not count);
- the coordinator and the provider never import each other (both import ``darkbloom.wire``);
- no module over MAX_LINES lines;
- production code reads no ``DARKBLOOM_TEST_*`` variable (test hooks live under tests/);
- every module (``__init__.py`` and migrations aside) has its line in the source tree that opens
  docs/architecture.md, and every ``.py`` that tree names exists.

The tree is the first fenced code block of docs/architecture.md. Each line is one entry, indented
two spaces per level under the folder it belongs to (a name ending in ``/``), then a ``#`` and what
the entry is for; a line that starts with ``#`` after its indent continues the description above.
The root entry is ``src/darkbloom/``, so ``lifecycle.py`` indented six spaces, below
``    inference/`` below ``  coordinator/``, names src/darkbloom/coordinator/inference/lifecycle.py.
Adding a module means adding its line there (with its one job); renaming or deleting one means
changing or removing its line.

Exit status 1 with one line per problem.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "darkbloom"
MAX_LINES = 300
SEPARATE = ("darkbloom.coordinator", "darkbloom.provider")
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


def imports(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
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


def main() -> int:
    paths = sorted(p for p in (ROOT / PACKAGE).rglob("*.py") if "migrations" not in p.parts)
    modules = {module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    for path in paths:
        name = module_name(path)
        # a package's import of its own submodules (re-exports in __init__) is not a dependency back
        graph[name] = {m for m in imports(path, modules)
                       if not (path.name == "__init__.py" and m.startswith(name + "."))}
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES}: split it by idea)")
        if "DARKBLOOM_TEST_" in path.read_text():
            problems.append(f"{path.relative_to(ROOT)}: reads a DARKBLOOM_TEST_* variable (test hooks live in tests/)")
        for mine, theirs in (SEPARATE, SEPARATE[::-1]):
            if name.startswith(mine):
                for target in graph[name]:
                    if target.startswith(theirs):
                        problems.append(f"{name} imports {target}: {mine} and {theirs} never import each other")
    for component in cycles(graph):
        problems.append("import cycle: " + " → ".join(component))
    problems += tree_problems(paths, ARCHITECTURE.read_text() if ARCHITECTURE.is_file() else "")
    for problem in problems:
        print(problem)
    if not problems:
        print(f"layout ok: {len(modules)} modules, no import cycle, none over {MAX_LINES} lines, "
              "each in the tree of docs/architecture.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
