"""The layout rules of docs/architecture.md, checked on src/darkbloom (run by `make test`):

- no import cycle between modules (imports under ``if TYPE_CHECKING:`` do not count);
- the coordinator and the provider never import each other (both import ``darkbloom.wire``);
- no module over MAX_LINES lines;
- production code reads no ``DARKBLOOM_TEST_*`` variable (test hooks live under tests/).

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
    for problem in problems:
        print(problem)
    if not problems:
        print(f"layout ok: {len(modules)} modules, no import cycle, none over {MAX_LINES} lines")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
