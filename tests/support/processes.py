"""Real coordinator and provider processes for tests: free ports, temporary DARKBLOOM_HOMEs."""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ADMIN_TOKEN = "test-admin-token"
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"DARKBLOOM_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    env.pop("DARKBLOOM_API_KEY", None)
    # one test client (127.0.0.1) stands for many people: no per-address sign-up and log-in limits
    env.setdefault("DARKBLOOM_SIGNUPS_PER_ADDRESS", "0")
    env.setdefault("DARKBLOOM_LOGIN_FAILURES_PER_ADDRESS", "0")
    # the suite signs up hundreds of accounts: argon2id at the floor the coordinator allows (OWASP's
    # minimum, a fifth of the default's CPU)
    env.setdefault("DARKBLOOM_PASSWORD_HASH_MEMORY_KIB", "19456")
    env.setdefault("DARKBLOOM_PASSWORD_HASH_TIME_COST", "2")
    env.update(extra or {})
    return env


def darkbloom_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "darkbloom.cli", *args]


def node_cmd(*args: str, first_token_delay: float = 0.0, direct_fail: int | None = None) -> list[str]:
    """`darkbloom ARGS…` (a node: `serve …`); with a test backend (tests/support/node_main.py) when
    ``first_token_delay`` (seconds before each request's first token) or ``direct_fail`` (the HTTP
    status direct mode answers every chat completion with) is set."""
    hooks: list[str] = []
    if first_token_delay:
        hooks += ["--first-token-delay", str(first_token_delay)]
    if direct_fail is not None:
        hooks += ["--direct-fail", str(direct_fail)]
    if not hooks:
        return darkbloom_cmd(*args)
    return [sys.executable, "-m", "tests.support.node_main", *hooks, *args]


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def spawn(args: list[str], home: Path, log_name: str, env: dict[str, str] | None = None) -> Process:
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / log_name
    handle = open(log_path, "wb")
    proc = subprocess.Popen(args, env=_env(home, env), stdout=handle, stderr=subprocess.STDOUT,
                            cwd=REPO_ROOT)  # `python -m tests.support…` needs the repository root
    return Process(proc, log_path)


@dataclass
class Coordinator:
    process: Process
    base_url: str
    home: Path
    database_url: str
    admin_token: str = ADMIN_TOKEN
    extra_args: list[str] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def metric(self, name: str) -> float:
        """The value of the unlabelled sample ``name`` on /metrics (0 before it is first counted)."""
        found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(self.base_url + "/metrics", timeout=10).text, re.M)
        return float(found.group(1)) if found else 0.0

    def stop(self) -> None:
        self.process.stop()


_LOGS = itertools.count(1)
_LISTENING = re.compile(r"Uvicorn running on http://[^\s:]+:(\d+)")


def start_coordinator(home: Path, database_url: str, *extra_args: str, port: int | None = None,
                      env: dict[str, str] | None = None, program: list[str] | None = None) -> Coordinator:
    """A `darkbloom coordinator` process (``program``: another `darkbloom` than this tree's, such as a
    virtualenv's); it binds ``port`` (by default one the system chooses, read back from its log) and
    answers /health before this returns."""
    if "--min-trust" not in extra_args:
        # test nodes are not enrolled (self_signed); the production default floor is hardware
        extra_args = ("--min-trust", "self_signed", *extra_args)
    args = [*(program or darkbloom_cmd()), "coordinator", "--port", str(port or 0), "--database-url", database_url,
            "--admin-token", ADMIN_TOKEN, *extra_args]
    process = spawn(args, home, f"coordinator-{next(_LOGS)}.log", env)
    base_url = f"http://127.0.0.1:{port or listening_port(process)}"
    wait_http(base_url + "/health", process)
    return Coordinator(process, base_url, home, database_url, extra_args=list(extra_args))


def listening_port(process: Process, timeout: float = 60) -> int:
    """The port a server started with ``--port 0`` bound, from uvicorn's "Uvicorn running on" line."""
    def bound() -> int | None:
        if process.proc.poll() is not None:
            raise RuntimeError(f"process exited early:\n{process.log()}")
        found = _LISTENING.search(process.log())
        return int(found.group(1)) if found else None
    return int(wait_until(bound, timeout=timeout, interval=0.05, what="the server's listening port"))


@contextmanager
def sqlite_coordinator(root: Path, *extra_args: str) -> Iterator[Coordinator]:
    """A coordinator on its own SQLite database under ``root``, stopped on leaving (a module's fixture)."""
    process = start_coordinator(root / "home", f"sqlite+aiosqlite:///{root / 'coordinator.db'}", *extra_args)
    try:
        yield process
    finally:
        process.stop()


def wait_http(url: str, process: Process, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"process exited early:\n{process.log()}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout} s:\n{process.log()}")


def wait_until(predicate: Any, timeout: float = 60, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def start_fixed_upstream(home: Path, *args: str) -> tuple[Process, str]:
    """bench/fixed_upstream.py (a fixed-response OpenAI-compatible fake) on a free port;
    ``--delay``/``--first-delay`` slow it down. Returns the process and its base URL."""
    port = free_port()
    process = spawn([sys.executable, str(REPO_ROOT / "bench" / "fixed_upstream.py"), str(port), *args], home,
                    f"upstream-{port}.log")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if process.proc.poll() is not None:
            raise AssertionError(f"fixed upstream exited:\n{process.log()}")
        try:
            httpx.get(url + "/", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, interval=0.05, what="fixed upstream")
    return process, url
