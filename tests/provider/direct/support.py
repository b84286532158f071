"""Helpers for the direct-mode tests: the docs snippet, local.json, darkbloom chat, usage rows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.support.accounts import Account
from tests.support.processes import Coordinator, _env, darkbloom_cmd, wait_until

ROOT = Path(__file__).resolve().parents[3]
MODEL = "smollm2-135m"
SHORT = [{"role": "user", "content": "Name one planet."}]


def docs_snippet() -> str:
    """The python block of docs/direct-mode.md marked `snippet: direct-first`."""
    text = (ROOT / "docs" / "direct-mode.md").read_text()
    match = re.search(r"<!-- snippet: direct-first[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/direct-mode.md lost its direct-first snippet"
    return match.group(1)


def run_python(code: str, home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=_env(home, env), capture_output=True, text=True,
                          timeout=120)


def run_chat(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(darkbloom_cmd("chat", *args), env=_env(home, env), capture_output=True, text=True,
                          timeout=120)


def wait_discovery(home: Path, timeout: float = 120) -> dict[str, Any]:
    path = home / "local.json"
    return wait_until(lambda: path.exists() and json.loads(path.read_text()), timeout=timeout, interval=0.1,
                      what="local.json")


def usage_rows(coord: Coordinator, account: Account) -> list[dict[str, Any]]:
    response = httpx.get(coord.api_url + "/payments/usage", headers=account.headers())
    response.raise_for_status()
    return response.json()["data"]
