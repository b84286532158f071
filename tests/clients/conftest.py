"""The clients' own matrix: one real coordinator and one real node on the bundled SmolLM2 for the
whole package, and the recorder that writes each (client, feature) outcome to
tests/clients/.results.json, from which scripts/compatibility_table.py makes docs/compatibility.md.

A test names its cells with ``@cell(client, feature, …)`` (tests/clients/support.py). Nothing here
talks to anything but 127.0.0.1: the clients' telemetry and downloads are switched off below, and
while the stack runs any proxied (non-loopback) HTTP request goes to a dead local port and fails.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from typing import Any, Iterator

import pytest

from tests.clients.support import CLIENT_PACKAGES, NODE_DIR, RESULTS, Stack
from tests.support.accounts import create_account, login_node, start_node, wait_model_listed
from tests.support.processes import free_port, start_coordinator

# before any client is imported: no tracing exports, no cost-map download, no hub lookups
for _name, _value in {"OPENAI_AGENTS_DISABLE_TRACING": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                      "LITELLM_TELEMETRY": "False", "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_TRACING": "false",
                      "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}.items():
    os.environ[_name] = _value

_outcomes: dict[str, dict[str, Any]] = {}
_collected: dict[str, list[list[str]]] = {}
_spent = [0.0]  # seconds in this directory's tests: setup (the package's coordinator and node), call, teardown


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cell(client, feature): the cell of docs/compatibility.md this test decides")


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("clients")
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}")
    node = None
    try:
        owner = create_account(coord, credit_micro_usd=1_000_000)
        consumer = create_account(coord, credit_micro_usd=100_000_000)
        broke = create_account(coord)
        node_home = root / "node"
        device_token = login_node(coord, node_home, owner)
        # the clients' multi-turn tool conversations run near 2048 tokens; the bundled model is trained
        # for 8192: serve 4096 so the coordinator's context check (docs/models.md) leaves them room
        (node_home / "provider.toml").write_text("[backend]\ncontext_length = 4096\n")
        node = start_node(coord, node_home, "--max-concurrency", "2")
        wait_model_listed(coord, consumer)
        with pytest.MonkeyPatch.context() as env:
            for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
                env.delenv(name, raising=False)
            dead = f"http://127.0.0.1:{free_port()}"
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
                env.setenv(name, dead)
            env.setenv("NO_PROXY", "127.0.0.1,localhost")
            env.setenv("no_proxy", "127.0.0.1,localhost")
            yield Stack(coord, owner, consumer, broke, node, root, device_token)
    finally:
        if node is not None:
            node.stop()
        coord.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every matrix test, deselected ones included, so that the table can tell "not run" from "—"."""
    for item in items:
        cells = [list(mark.args) for mark in item.iter_markers("cell")]
        if cells:
            _collected[item.nodeid] = cells


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    _spent[0] += report.duration  # this directory's items only: the rest of a `make test` run is not its time
    cells = [list(mark.args) for mark in item.iter_markers("cell")]
    if not cells or (report.when != "call" and report.passed):
        return
    entry = _outcomes.setdefault(item.nodeid, {"cells": cells, "outcome": "passed", "reason": None})
    if report.failed or report.skipped:
        entry["outcome"] = "failed" if report.failed else "skipped"
        entry["reason"] = _reason(call, report)
    if report.when == "call":
        entry["seconds"] = round(report.duration, 2)


def _reason(call: pytest.CallInfo[None], report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    elif call.excinfo is not None:
        text = call.excinfo.exconly()
    else:
        text = str(report.longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else "failed"
    return first if len(first) <= 200 else first[:197] + "…"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Merge this run's outcomes into .results.json (a partial run updates only its own tests)."""
    if not _outcomes:
        return
    try:
        results = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        results = {}
    tests = results.get("tests", {})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for nodeid, entry in _outcomes.items():
        tests[nodeid] = {**entry, "at": now}
    for nodeid, cells in _collected.items():
        tests.setdefault(nodeid, {"cells": cells, "outcome": "not run", "reason": None})
    files = {nodeid.split("::")[0] for nodeid in _collected}
    tests = {nodeid: test for nodeid, test in tests.items()  # tests since removed from a collected file
             if nodeid in _collected or nodeid.split("::")[0] not in files}
    results.update({"tests": tests, "versions": _versions(), "updated": now})
    if len(_outcomes) == len(tests):  # every test of the matrix ran: the table's timing
        results["full_run"] = {"tests": len(_outcomes), "seconds": round(_spent[0], 1), "at": now}
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str] = {}
    for package in CLIENT_PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    found["python"] = platform.python_version()
    node = shutil.which("node")
    found["node"] = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip() if node else "?"
    for package in ("openai", "ai", "@ai-sdk/openai"):
        manifest = NODE_DIR / "node_modules" / package / "package.json"
        found[f"npm:{package}"] = json.loads(manifest.read_text())["version"] if manifest.exists() else "not installed"
    return found

