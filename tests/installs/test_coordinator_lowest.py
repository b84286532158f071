"""The coordinator with the lowest versions it declares (`uv pip install --resolution lowest-direct`):
each lower bound in pyproject.toml is one it runs on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.installs.coordinator_checks import serve_a_request_through
from tests.installs.support import INSTALL_TIMEOUT, fresh_venv, project_copy, uv_install_lowest, versions

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(INSTALL_TIMEOUT + 600)]  # a cold cache compiles


def test_the_coordinator_installs_with_the_lowest_declared_versions_and_serves(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv")
    uv_install_lowest(venv, str(project_copy(tmp_path)))
    installed = versions(venv)
    assert installed["fastapi"] == "0.110.0" and installed["websockets"] == "13.0", installed  # lowest indeed
    serve_a_request_through(venv, tmp_path)
