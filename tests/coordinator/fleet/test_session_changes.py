"""What the registry's views of a session depend on changes only through the session's methods
(``fleet/session.py``), each of which tells the registry what kind of change it made: nothing else in
the coordinator assigns one of those attributes, so no change can leave a view stale."""

from __future__ import annotations

import ast
from pathlib import Path

import darkbloom.coordinator

COORDINATOR = Path(darkbloom.coordinator.__file__).parent
WATCHED = frozenset({"_active", "decode_tps", "loaded_models", "online", "draining", "untrusted_reason",
                     "trust_level", "runtime_verified", "public_key", "account_id", "machine_id",
                     "challenge_passed_at"})


def _assigned(node: ast.AST) -> list[ast.Attribute]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    found: list[ast.Attribute] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def _writers(path: Path) -> list[str]:
    """``file:line .attribute`` of every assignment to a watched attribute of another object than
    ``self`` (other classes' own fields of those names are theirs; a request's ``state`` is no session)."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(COORDINATOR)}:{target.lineno} .{target.attr}"
            for node in ast.walk(tree) for target in _assigned(node)
            if target.attr in WATCHED and ast.unparse(target.value) not in ("self", "request.state")]


def test_only_the_session_changes_what_its_views_depend_on() -> None:
    assert [writer for path in sorted(COORDINATOR.rglob("*.py")) for writer in _writers(path)] == []


def test_no_attribute_hook_in_the_coordinator() -> None:
    assert [path for path in COORDINATOR.rglob("*.py") if "__setattr__" in path.read_text()] == []
