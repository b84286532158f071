"""`$DARKBLOOM_HOME`: one rule for the node, the coordinator and the client."""

from __future__ import annotations

from pathlib import Path

import pytest

from darkbloom.paths import darkbloom_home


def test_the_home_is_the_variable_or_the_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DARKBLOOM_HOME", str(tmp_path / "given"))
    assert darkbloom_home() == tmp_path / "given"
    monkeypatch.delenv("DARKBLOOM_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert darkbloom_home() == tmp_path / "user" / ".config" / "darkbloom"


def test_a_reader_does_not_create_the_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DARKBLOOM_HOME", str(tmp_path / "home"))
    assert darkbloom_home(create=False) == tmp_path / "home" and not (tmp_path / "home").exists()
    assert darkbloom_home().is_dir()
