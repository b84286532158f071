"""`pip install '.[mlx]'` — a node on the MLX backend alone, without the llama.cpp extra — into a fresh
virtualenv: `darkbloom start --local --backend mlx` serves an MLX model directory in direct mode, and
`darkbloom stop` stops it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.installs.support import INSTALL_TIMEOUT, blame, fresh_venv, pip_install, project_copy, versions
from tests.support.mlx_model import converted_smollm2
from tests.support.processes import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(INSTALL_TIMEOUT + 600)]


def test_an_mlx_node_alone_installs_and_serves_in_direct_mode(tmp_path: Path) -> None:
    model = converted_smollm2()
    venv = fresh_venv(tmp_path / "venv")
    pip_install(venv, f"{project_copy(tmp_path)}[mlx]")
    installed = versions(venv)
    assert "mlx-lm" in installed and "llama-cpp-python" not in installed
    home = tmp_path / "home"
    env = {**os.environ, "DARKBLOOM_HOME": str(home)}
    darkbloom = str(venv / "bin" / "darkbloom")
    started = subprocess.run([darkbloom, "start", "--local", "--port", str(free_port()), "--backend", "mlx",
                              "--model", f"smol={model}"], env=env, capture_output=True, text=True, timeout=180)
    output = started.stdout + started.stderr
    assert started.returncode == 0, f"{output}\n({blame(venv, output)})"
    try:
        local = wait_until(lambda: (home / "local.json").is_file() and json.loads((home / "local.json").read_text()),
                           timeout=120, interval=0.2, what="local.json")

        def answered() -> httpx.Response | None:
            try:
                return httpx.post(local["base_url"] + "/chat/completions", timeout=120,
                                  headers={"Authorization": f"Bearer {local['api_key']}"},
                                  json={"model": "smol", "max_tokens": 8, "temperature": 0,
                                        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            except httpx.ConnectError:
                return None

        answer = wait_until(answered, timeout=180, interval=0.3, what="direct mode to answer")
        logs = "\n".join(p.read_text(errors="replace") for p in home.glob("*.log"))
        assert answer.status_code == 200, f"{answer.text}\n({blame(venv, logs)})\n{logs[-4000:]}"
        assert answer.json()["choices"][0]["message"]["content"].startswith("The capital of France")
        assert 0 < answer.json()["usage"]["completion_tokens"] <= 8
    finally:
        stopped = subprocess.run([darkbloom, "stop"], env=env, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
