"""`pip install '.[mlx]'` — a node on the MLX backend alone, without the llama.cpp extra — into a fresh
virtualenv: `darkbloom start --local --backend mlx` serves an MLX model directory in direct mode, and
`darkbloom stop` stops it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.installs.support import (INSTALL_TIMEOUT, fresh_venv, local_chat, local_node, pip_install, project_copy,
                                    versions)
from tests.support.mlx_model import converted_smollm2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(INSTALL_TIMEOUT + 600)]


def test_an_mlx_node_alone_installs_and_serves_in_direct_mode(tmp_path: Path) -> None:
    model = converted_smollm2()
    venv = fresh_venv(tmp_path / "venv")
    pip_install(venv, f"{project_copy(tmp_path)}[mlx]")
    installed = versions(venv)
    assert "mlx-lm" in installed and "llama-cpp-python" not in installed
    home = tmp_path / "home"
    with local_node(venv, home, "--backend", "mlx", "--model", f"smol={model}") as local:
        answer = local_chat(venv, home, local, {
            "model": "smol", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert answer["choices"][0]["message"]["content"].startswith("The capital of France")
    assert 0 < answer["usage"]["completion_tokens"] <= 8
