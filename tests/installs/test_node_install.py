"""`pip install '.[node]'` — a node alone — into a fresh virtualenv: `darkbloom start --local` serves
the bundled model in direct mode, and `darkbloom stop` stops it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.installs.support import INSTALL_TIMEOUT, fresh_venv, local_chat, local_node, pip_install, project_copy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(INSTALL_TIMEOUT + 600)]  # a cold cache compiles


def test_a_node_alone_installs_and_serves_the_bundled_model_in_direct_mode(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv")
    pip_install(venv, f"{project_copy(tmp_path)}[node]")
    home = tmp_path / "home"
    with local_node(venv, home) as local:
        answer = local_chat(venv, home, local, {"model": "smollm2-135m", "max_tokens": 8,
                                                "messages": [{"role": "user", "content": "Say hi"}]})
    assert answer["usage"]["completion_tokens"] > 0
