"""schemathesis against the coordinator's own OpenAPI document (issue 12).

A real coordinator process; a funded account whose own machine (a raw provider that answers every
request at once) serves the bundled model, so completions, streams and Self-Route reach 200. Then
schemathesis runs with the account's API key and with the admin token: fixed seed, a bounded number
of cases per operation, the examples, coverage and fuzzing phases. Every response must be
documented (status, media type, headers, body schema, each SSE event), no status may be a server
error, OPTIONS and undeclared methods must answer with the path's full ``Allow``, and operations
that need a credential must refuse a request without one.

"Server error" means any 5xx but 503: a 503 is the documented answer to a request the fleet
cannot serve as asked (``X-Darkbloom-Route: self`` for a model the machine does not load, …);
502 and 504 cannot happen with a provider that always answers, so they count as failures too.

The console's HTML pages are in the document but not fuzzed here (tests/console drives them), and
the provider WebSocket is not an HTTP operation. On failure the message holds schemathesis' report
(a curl line per failing case) and the coordinator's log.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.accounts import Account, create_account, device_token, wait_model_listed
from tests.support.processes import ADMIN_TOKEN, Coordinator, sqlite_coordinator
from tests.support.raw_provider import RawProvider

# as long as the schemathesis run itself may take (its subprocess timeout below): a run covers every
# documented body's schema (about 4 min alone for the API key's surface), and on a busy 2-core machine
# one surface has taken over 600 s
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SEED = "20240612"
MAX_EXAMPLES = 100  # per operation and phase: the file takes about 1.5 min on 2 cores
CHECKS = ",".join(("not_a_server_error", "status_code_conformance", "content_type_conformance",
                   "response_headers_conformance", "response_schema_conformance", "unsupported_method",
                   "allow_header_conformance", "ignored_auth"))
CONFIG = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "503"]
"""
NOT_FUZZED = "^/console"  # the HTML pages
# Run after the others: with ids seen in listings they unlink the machine and edit or delete keys,
# possibly the very key the run authenticates with.
DESTRUCTIVE = ("DELETE /v1/me/providers/{machine_id}", "DELETE /v1/keys/{key_id}", "PATCH /v1/keys/{key_id}")


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    # the raw provider sends no heartbeats: keep it connected for the whole module
    with sqlite_coordinator(tmp_path_factory.mktemp("schemathesis"), "--heartbeat-timeout", "3600") as process:
        yield process


@pytest.fixture(scope="module")
def account(coord: Coordinator) -> Account:
    return create_account(coord, credit_micro_usd=100_000_000)


class _AnsweringMachine:
    """The account's own machine: a raw provider, in its own thread and event loop, answering every
    request with one sealed chunk."""

    def __init__(self, base_url: str, token: str) -> None:
        self.provider = RawProvider(base_url, auth_token=token, max_concurrency=4)
        self.registered = threading.Event()
        self.stopped_by: BaseException | None = None
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        await self.provider.register()
        self.registered.set()
        try:
            while True:
                request, _body = await self.provider.next_request()
                await self.provider.answer(request, "ok")
        except BaseException as exc:  # noqa: BLE001 - the socket closed (unlinked, coordinator stopped)
            self.stopped_by = exc


@pytest.fixture(scope="module")
def own_machine(coord: Coordinator, account: Account) -> _AnsweringMachine:
    machine = _AnsweringMachine(coord.base_url, device_token(coord, account))
    machine.thread.start()
    assert machine.registered.wait(60), "the raw provider did not register"
    wait_model_listed(coord, account)
    return machine


def _schemathesis(coord: Coordinator, token: str, workdir: Path, *filters: str) -> str:
    """One schemathesis run; returns its report, asserting it found nothing."""
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
               "run", coord.base_url + "/openapi.json", "--header", f"Authorization: Bearer {token}",
               "--checks", CHECKS, "--phases", "examples,coverage,fuzzing", "--seed", SEED,
               "--max-examples", str(MAX_EXAMPLES), "--generation-database", "none", "--workers", "1",
               "--request-timeout", "30", "--suppress-health-check", "all", *filters]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=workdir)
    report = run.stdout + run.stderr
    assert run.returncode == 0, (f"schemathesis found failures:\n{report}\n"
                                 f"--- coordinator log (tail) ---\n{coord.process.log()[-20000:]}")
    cases = re.search(r"(\d+) generated, (\d+) passed", report)
    assert cases is not None and cases[1] == cases[2] and int(cases[1]) > 0, report
    print(f"schemathesis: {cases[0]}")
    return report


def test_api_key(coord: Coordinator, account: Account, own_machine: _AnsweringMachine, tmp_path: Path) -> None:
    excluded = [arg for name in DESTRUCTIVE for arg in ("--exclude-name", name)]
    _schemathesis(coord, account.api_key, tmp_path, "--exclude-path-regex", f"{NOT_FUZZED}|^/v1/admin/",
                  *excluded)
    assert own_machine.stopped_by is None, f"the machine went away during the run: {own_machine.stopped_by!r}"


def test_api_key_destructive(coord: Coordinator, account: Account, own_machine: _AnsweringMachine,
                             tmp_path: Path) -> None:
    """Keys and machines with the listings that feed them real ids."""
    _schemathesis(coord, account.api_key, tmp_path, "--include-path-regex", "^/v1/(keys|me/providers)")


def test_admin_token(coord: Coordinator, tmp_path: Path) -> None:
    _schemathesis(coord, ADMIN_TOKEN, tmp_path, "--include-path-regex", "^/v1/admin/")
