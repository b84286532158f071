"""Installs made the way users make them: a fresh virtualenv, the project copied out of this tree (so
concurrent installs never share a build directory), pip or uv resolving from the package index (with
pip's cache, so a warm machine installs in seconds). A failure names the packages and versions its
traceback ran through."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx

from tests.support.processes import REPO_ROOT, free_port, wait_until

INSTALL_TIMEOUT = 1800  # a cold cache builds llama-cpp-python from source: ~14 minutes on 2 cores
_SITE_PACKAGES = re.compile(r"site-packages/([A-Za-z0-9_]+)")


def project_copy(root: Path) -> Path:
    """What `pip install .` needs of this repository, copied to ``root``."""
    target = root / "darkbloom-src"
    shutil.copytree(REPO_ROOT / "src", target / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, target / name)
    return target


def fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path


def pip_install(venv: Path, requirement: str) -> None:
    _install([str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off", requirement], venv)


def uv_install_lowest(venv: Path, requirement: str) -> None:
    """The lowest versions the project declares for its direct dependencies (their own dependencies
    resolved as usual), as `uv pip install --resolution lowest-direct` picks them."""
    uv = Path(sys.executable).parent / "uv"
    _install([str(uv), "pip", "install", "--python", str(venv / "bin" / "python"), "--resolution",
              "lowest-direct", requirement], venv)


def _install(command: list[str], venv: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def versions(venv: Path) -> dict[str, str]:
    """Every distribution installed in ``venv``: name → version."""
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, timeout=120, check=True)
    return {entry["name"].lower(): entry["version"] for entry in json.loads(listed.stdout)}


def blame(venv: Path, output: str) -> str:
    """The distributions (name==version) whose files ``output``'s tracebacks ran through, so that a
    failure on a new or old release says which one."""
    modules = sorted(set(_SITE_PACKAGES.findall(output)))
    if not modules:
        return "no installed package in the traceback"
    found = subprocess.run([str(venv / "bin" / "python"), "-c", (
        "import importlib.metadata as m, json, sys; owners = m.packages_distributions(); "
        "print(json.dumps({mod: [f'{d}=={m.version(d)}' for d in owners.get(mod, [])] for mod in sys.argv[1:]}))"
    ), *modules], capture_output=True, text=True, timeout=60)
    try:
        owners = json.loads(found.stdout)
    except json.JSONDecodeError:
        return f"packages in the traceback: {', '.join(modules)}"
    return "packages in the traceback: " + ", ".join(
        " / ".join(owners.get(module) or [module]) for module in modules)


@contextlib.contextmanager
def local_node(venv: Path, home: Path, *args: str) -> Iterator[dict[str, Any]]:
    """`darkbloom start --local` from ``venv`` in ``home`` (with ``args``): its local.json while it runs,
    `darkbloom stop` after."""
    env = {**os.environ, "DARKBLOOM_HOME": str(home)}
    darkbloom = str(venv / "bin" / "darkbloom")
    started = subprocess.run([darkbloom, "start", "--local", "--port", str(free_port()), *args], env=env,
                             capture_output=True, text=True, timeout=180)
    output = started.stdout + started.stderr
    assert started.returncode == 0, f"{output}\n({blame(venv, output)})"
    try:
        yield wait_until(lambda: (home / "local.json").is_file() and json.loads((home / "local.json").read_text()),
                         timeout=120, interval=0.2, what="local.json")
    finally:
        stopped = subprocess.run([darkbloom, "stop"], env=env, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def local_chat(venv: Path, home: Path, local: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A direct-mode chat completion, asked until the node listens; its answer, or the node's logs."""
    def answered() -> httpx.Response | None:
        try:
            return httpx.post(local["base_url"] + "/chat/completions", timeout=120, json=body,
                              headers={"Authorization": f"Bearer {local['api_key']}"})
        except httpx.ConnectError:
            return None

    answer = wait_until(answered, timeout=180, interval=0.3, what="direct mode to answer")
    logs = "\n".join(p.read_text(errors="replace") for p in home.glob("*.log"))
    assert answer.status_code == 200, f"{answer.text}\n({blame(venv, logs)})\n{logs[-4000:]}"
    result: dict[str, Any] = answer.json()
    return result
