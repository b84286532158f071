"""The model store's tests: a Hub look-alike serving the bundled GGUF (tests/support/hub_server.py)
and `darkbloom` run as a process against it, with the Hub client's own files kept in a scratch
HF_HOME."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.hub_server import HubServer
from tests.support.processes import REPO_ROOT, darkbloom_cmd

BUNDLED_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ONE = "test-org/SmolLM2-135M-GGUF"  # one GGUF and a README
MIRROR = "mirror-org/smollm2-mirror"  # the same GGUF under another repo and file name
TWO = "test-org/two-quants"  # two GGUF files
NOT_GGUF = "test-org/fake-gguf"  # a .gguf that is not GGUF
BACKSLASH = "test-org/backslash"  # one GGUF whose name holds a backslash
BACKSLASH_UP = "test-org/backslash-up"  # one GGUF named like a path out of its folder, with a backslash


@pytest.fixture
def hub(gguf: Path) -> Iterator[HubServer]:
    with HubServer({ONE: {BUNDLED_NAME: gguf, "README.md": b"# SmolLM2 135M\n"},
                    MIRROR: {"smollm2-135m-q4_1.gguf": gguf},
                    TWO: {"model.Q4_1.gguf": gguf, "model-copy.Q4_1.gguf": gguf},
                    NOT_GGUF: {"weights.gguf": b"<html>not a model</html>" * 100},
                    BACKSLASH: {"a\\b.gguf": gguf}, BACKSLASH_UP: {"..\\evil.gguf": gguf}}) as server:
        yield server


@dataclass
class Node:
    """A DARKBLOOM_HOME and the environment `darkbloom` runs in against the test Hub."""
    home: Path
    env: dict[str, str]

    @property
    def store(self) -> Path:
        return self.home / "models"

    @property
    def hf_home(self) -> Path:
        return Path(self.env["HF_HOME"])

    def run(self, *args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(darkbloom_cmd(*args), env={**self.env, **env}, cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=timeout)

    def popen(self, *args: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(darkbloom_cmd(*args), env=self.env, cwd=REPO_ROOT, **kwargs)

    def entries(self) -> list[str]:
        """What the store holds, besides its downloads in progress."""
        return sorted(p.name for p in self.store.iterdir() if p.name != ".partial") if self.store.exists() else []

    def partials(self) -> list[Path]:
        return sorted(self.store.glob(".partial/*/*.incomplete"))


def pulled(result: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    """The `ID PATH` line a successful pull prints."""
    assert result.returncode == 0, result.stderr
    model_id, path = result.stdout.strip().split(" ", 1)
    return model_id, Path(path)


def failed(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one error line a failed command prints last on stderr (after any progress lines)."""
    assert result.returncode == code, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return errors[0]


def node_env(home: Path, hub_url: str, scratch: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_TOKEN", "DARKBLOOM_COORDINATOR", "DARKBLOOM_API_KEY", "HF_HUB_OFFLINE")}
    # "0", not left out: processes.spawn lays this over os.environ, where tests/clients sets HF_HUB_OFFLINE=1
    env.update(DARKBLOOM_HOME=str(home), HF_ENDPOINT=hub_url, HF_HOME=str(scratch / "hf-home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
    return env


@pytest.fixture
def node(tmp_path: Path, hub: HubServer) -> Node:
    home = tmp_path / "home"
    home.mkdir()
    return Node(home, node_env(home, hub.url, tmp_path))
