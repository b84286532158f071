"""`pip install '.[node]'` — a node alone — into a fresh virtualenv: `darkbloom start --local` serves
the bundled model in direct mode, and `darkbloom stop` stops it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.installs.support import INSTALL_TIMEOUT, blame, fresh_venv, pip_install, project_copy
from tests.support.processes import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(INSTALL_TIMEOUT + 600)]  # a cold cache compiles


def test_a_node_alone_installs_and_serves_the_bundled_model_in_direct_mode(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv")
    pip_install(venv, f"{project_copy(tmp_path)}[node]")
    home = tmp_path / "home"
    env = {**os.environ, "DARKBLOOM_HOME": str(home)}
    darkbloom = str(venv / "bin" / "darkbloom")
    started = subprocess.run([darkbloom, "start", "--local", "--port", str(free_port())], env=env,
                             capture_output=True, text=True, timeout=180)
    output = started.stdout + started.stderr
    assert started.returncode == 0, f"{output}\n({blame(venv, output)})"
    try:
        local = wait_until(lambda: (home / "local.json").is_file() and json.loads((home / "local.json").read_text()),
                           timeout=120, interval=0.2, what="local.json")

        def answered() -> httpx.Response | None:
            try:
                return httpx.post(local["base_url"] + "/chat/completions", timeout=120,
                                  headers={"Authorization": f"Bearer {local['api_key']}"},
                                  json={"model": "smollm2-135m", "max_tokens": 8,
                                        "messages": [{"role": "user", "content": "Say hi"}]})
            except httpx.ConnectError:
                return None

        answer = wait_until(answered, timeout=120, interval=0.3, what="direct mode to answer")
        logs = "\n".join(p.read_text(errors="replace") for p in home.glob("*.log"))
        assert answer.status_code == 200, f"{answer.text}\n({blame(venv, logs)})\n{logs[-4000:]}"
        assert answer.json()["usage"]["completion_tokens"] > 0
    finally:
        stopped = subprocess.run([darkbloom, "stop"], env=env, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
