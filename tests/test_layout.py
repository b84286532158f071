"""scripts/check_layout.py: the checker finds what it is meant to find, and the tree passes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import check_layout  # noqa: E402


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """An empty `darkbloom` package under a temporary source root the checker reads."""
    root = tmp_path / "darkbloom"
    root.mkdir()
    (root / "__init__.py").write_text("")
    check_layout.ROOT = tmp_path
    try:
        yield root
    finally:
        check_layout.ROOT = Path(check_layout.__file__).resolve().parent.parent / "src"


def _modules(package: Path, sources: dict[str, str]) -> list[Path]:
    paths = [package / "__init__.py"]
    for name, text in sources.items():
        path = package.joinpath(*name.split(".")).with_suffix(".py")
        for folder in reversed(path.relative_to(package).parents[:-1]):
            (package / folder).mkdir(exist_ok=True)
            (package / folder / "__init__.py").touch()
            paths.append(package / folder / "__init__.py")
        path.write_text(text)
        paths.append(path)
    return sorted(set(paths))


def _found(package: Path, sources: dict[str, str]) -> tuple[list[str], list[str]]:
    problems, warnings = check_layout.check(_modules(package, sources), "")
    return [p for p in problems if "docs/architecture.md" not in p], warnings


def test_cycles_are_found_and_acyclic_graphs_pass() -> None:
    assert check_layout.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert check_layout.cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_cycle_is_shown_in_import_order() -> None:
    graph = {"a": {"c"}, "b": {"a"}, "c": {"b"}}
    assert check_layout.cycle_path(["a", "b", "c"], graph) == ["a", "c", "b", "a"]


def test_imports_under_type_checking_are_read_only_when_asked(package: Path) -> None:
    _modules(package, {"one": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from darkbloom import two\nfrom darkbloom.three import x\n",
                       "two": "x = 1\n", "three": "x = 1\n"})
    modules = {"darkbloom", "darkbloom.one", "darkbloom.two", "darkbloom.three"}
    assert check_layout.imports(package / "one.py", modules) == {"darkbloom.three"}
    assert check_layout.imports(package / "one.py", modules, type_checking=True) == {
        "darkbloom", "darkbloom.two", "darkbloom.three"}


def test_a_runtime_cycle_fails(package: Path) -> None:
    problems, _ = _found(package, {"one": "from darkbloom import two\n", "two": "from darkbloom import one\n"})
    assert problems == ["import cycle: darkbloom.one → darkbloom.two → darkbloom.one"]


def test_a_cycle_through_type_checking_imports_fails(package: Path) -> None:
    sources = {"one": "from darkbloom import two\n",
               "two": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from darkbloom import one\n"}
    line = "import cycle: darkbloom.one → darkbloom.two → darkbloom.one (under TYPE_CHECKING)"
    assert _found(package, sources) == ([line], [])


def test_only_the_app_factory_imports_the_http_edge(package: Path) -> None:
    sources = {"coordinator.http.auth": "x = 1\n",
               "coordinator.http.routes": "from darkbloom.coordinator.http import auth\n",
               "coordinator.app": "from darkbloom.coordinator.http import routes\n",
               "coordinator.money": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from darkbloom.coordinator.http.auth import x\n"}
    problems, _ = _found(package, sources)
    assert problems == ["darkbloom.coordinator.money imports darkbloom.coordinator.http.auth: the layers below "
                        "the HTTP edge never import it (move what they share out of http/)"]


def test_a_long_module_is_a_warning_not_a_failure(package: Path) -> None:
    problems, warnings = _found(package, {"long": "x = 1\n" * (check_layout.WARN_LINES + 1)})
    assert problems == []
    assert warnings == [f"darkbloom/long.py: {check_layout.WARN_LINES + 1} lines (over {check_layout.WARN_LINES}: "
                        "is it still one idea?)"]


def test_the_source_tree_keeps_the_layout_rules() -> None:
    result = subprocess.run([sys.executable, str(Path(check_layout.__file__))], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
