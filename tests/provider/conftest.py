from __future__ import annotations

from pathlib import Path

import pytest

from darkbloom.models_bundled import bundled_gguf_path


@pytest.fixture(scope="session")
def gguf() -> Path:
    return bundled_gguf_path()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("DARKBLOOM_HOME", str(path))
    return path
