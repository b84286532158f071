"""scripts/check_layout.py: the checker finds what it is meant to find, and the tree passes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import check_layout  # noqa: E402


def test_cycles_are_found_and_acyclic_graphs_pass() -> None:
    assert check_layout.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert check_layout.cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_skip_type_checking_blocks(tmp_path: Path, monkeypatch: object) -> None:
    package = tmp_path / "darkbloom"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from darkbloom import two\nfrom darkbloom.three import x\n")
    for name in ("two", "three"):
        (package / f"{name}.py").write_text("x = 1\n")
    check_layout.ROOT = tmp_path
    try:
        modules = {"darkbloom", "darkbloom.one", "darkbloom.two", "darkbloom.three"}
        assert check_layout.imports(package / "one.py", modules) == {"darkbloom.three"}
    finally:
        check_layout.ROOT = Path(check_layout.__file__).resolve().parent.parent / "src"


def test_the_source_tree_keeps_the_layout_rules() -> None:
    result = subprocess.run([sys.executable, str(Path(check_layout.__file__))], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
