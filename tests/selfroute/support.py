"""Real processes for the Self-Route tests: one coordinator (or three replicas of one) per module,
provider nodes on the `openai` backend in front of bench/fixed_upstream.py (instant, deterministic
answers) or on the bundled GGUF, and `RawProvider` sockets driven from a background thread for states
a real node cannot easily be put in (an unverified runtime, a stale challenge) or to prove that a
provider never saw a request.

Everything a user can see goes through the HTTP API; the database is read (never written) only
for money that no endpoint shows, such as the platform account's withdrawable balance.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from darkbloom.store.schema import PLATFORM_ACCOUNT_ID

from tests.support.accounts import Account, balance, create_account, device_token
from tests.support.processes import Coordinator, Process, node_cmd, spawn, start_coordinator, wait_until
from tests.support.processes import start_fixed_upstream
from tests.support.raw_provider import ThreadedRaw
from tests.support.replicas import replica_set

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
FIXED_ANSWER = "The quick brown fox jumps over the lazy dog."  # what bench/fixed_upstream.py says
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16}
SELF = {"X-Darkbloom-Route": "self"}
PREFER = {"X-Darkbloom-Route": "prefer"}
start_upstream = start_fixed_upstream


@dataclass
class Node:
    process: Process
    session_id: str
    home: Path

    def log(self) -> str:
        return self.process.log()

    def accepted(self) -> list[str]:
        """Request ids this node accepted, in order."""
        return re.findall(r"request (chatcmpl-\w+) accepted", self.log())

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        self.process.kill()


@dataclass
class Stack:
    """One coordinator (or, ``replicated``, three replicas of one on Postgres, Redis and NATS) and what
    a module starts on it; ``close`` stops everything. Machines connect to ``coordinator`` (replicated:
    to the first and the third replica, the ``machine_sides``, in turn); consumers call
    ``consumer_side`` (replicated: the second replica)."""

    root: Path
    coordinator: Coordinator
    processes: list[Process] = field(default_factory=list)
    raws: list["ThreadedRaw"] = field(default_factory=list)
    consumer: Coordinator | None = None
    machine_sides: list[Coordinator] = field(default_factory=list)
    _closing: list[Any] = field(default_factory=list)
    _linked: int = 0

    @classmethod
    def start(cls, root: Path, *coordinator_args: str, replicated: bool = False) -> "Stack":
        if replicated:
            replicas = contextlib.ExitStack()
            found = replicas.enter_context(replica_set(root / "replicas", 3, *coordinator_args))
            first, consumers, third = found.coordinators
            return cls(root, first, consumer=consumers, machine_sides=[first, third], _closing=[replicas])
        coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}",
                                  *coordinator_args)
        return cls(root, coord)

    @property
    def consumer_side(self) -> Coordinator:
        return self.consumer or self.coordinator

    def _machine_side(self) -> Coordinator:
        """Where the next machine connects: the one coordinator, or the machine replicas in turn."""
        if not self.machine_sides:
            return self.coordinator
        self._linked += 1
        return self.machine_sides[(self._linked - 1) % len(self.machine_sides)]

    @property
    def url(self) -> str:
        return self.consumer_side.api_url

    def close(self) -> None:
        for raw in self.raws:
            raw.close()
        for process in self.processes:
            process.stop()
        for closing in self._closing:
            closing.close()
        self.coordinator.stop()

    # accounts

    def account(self, credit: int = 0, **key_fields: object) -> Account:
        return create_account(self.coordinator, credit_micro_usd=credit, **key_fields)

    def key(self, account: Account, **fields: object) -> str:
        """Another API key of the account (made with its session token)."""
        response = httpx.post(self.url + "/keys", json={"name": "extra", **fields},
                              headers={"Authorization": f"Bearer {account.session}"})
        assert response.status_code == 201, response.text
        return str(response.json()["key"])

    def link(self, account: Account) -> str:
        """A `dkp-` device token for the account (one new machine), from the consumer side."""
        return device_token(self.consumer_side, account)

    # provider nodes

    def node(self, name: str, owner: Account | None, *, upstream: str | None = None,
             models: tuple[str, ...] = (MODEL,), max_concurrency: int = 2, first_token_delay: float = 0.0,
             extra: tuple[str, ...] = ()) -> Node:
        """A real `darkbloom serve` process, linked to ``owner`` (None: unowned). With ``upstream``
        it runs the `openai` backend in front of it; otherwise llama.cpp on ``models`` (ID or ID=PATH)."""
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        if owner is not None:
            token_path = home / "auth_token"
            token_path.write_text(self.link(owner) + "\n")
            os.chmod(token_path, 0o600)
        args = ["serve", "--coordinator", self._machine_side().base_url, "--max-concurrency", str(max_concurrency)]
        if upstream is not None:
            args += ["--backend", "openai", "--upstream-url", upstream]
        for model in models:
            args += ["--model", model]
        process = spawn(node_cmd(*args, *extra, first_token_delay=first_token_delay), home, "node.log")
        self.processes.append(process)

        def registered() -> str | None:
            if process.proc.poll() is not None:
                raise AssertionError(f"node {name} exited:\n{process.log()}")
            match = re.search(r"registered as (prov_\w+)", process.log())
            return match.group(1) if match else None

        session_id = str(wait_until(registered, timeout=90, interval=0.05, what=f"node {name} registered"))
        return Node(process, session_id, home)

    def raw(self, owner: Account | None, **options: Any) -> "ThreadedRaw":
        raw = ThreadedRaw(self._machine_side().base_url, self.link(owner) if owner is not None else None, **options)
        self.raws.append(raw)
        return raw

    # requests and reads

    def chat(self, token: str, headers: dict[str, str] | None = None, timeout: float = 90,
             **fields: object) -> httpx.Response:
        return httpx.post(self.url + "/chat/completions", json={**BODY, **fields},
                          headers={"Authorization": f"Bearer {token}", **(headers or {})}, timeout=timeout)

    def stream(self, token: str, headers: dict[str, str] | None = None, **fields: object) -> tuple[httpx.Response, str]:
        """A streamed chat completion (with the final usage chunk): the response and its whole SSE text."""
        body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, **fields}
        with httpx.stream("POST", self.url + "/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {token}", **(headers or {})}, timeout=90) as response:
            text = response.read().decode()
        return response, text

    def chat_raw_header(self, token: str, name: str, value: str, **fields: object) -> tuple[int, dict[str, str], Any]:
        """A chat completion with one header sent byte for byte as given (httpx refuses a value with
        leading or trailing spaces; http.client sends it as is). Returns status, headers, JSON body."""
        parts = urlsplit(self.consumer_side.base_url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=90)
        try:
            connection.request("POST", "/v1/chat/completions", body=json.dumps({**BODY, **fields}),
                               headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                                        name: value})
            response = connection.getresponse()
            body = json.loads(response.read())
            return response.status, {k.lower(): v for k, v in response.getheaders()}, body
        finally:
            connection.close()

    def get(self, path: str, token: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {token}", **(headers or {})},
                         timeout=30)

    def balance(self, account: Account) -> int:
        return balance(self.consumer_side, account)

    def usage(self, account: Account) -> list[dict[str, Any]]:
        response = self.get("/payments/usage?limit=500", account.session)
        assert response.status_code == 200, response.text
        return list(response.json()["data"])

    def earnings(self, account: Account) -> dict[str, Any]:
        response = self.get("/provider/earnings?limit=500", account.session)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def machines(self, account: Account) -> list[dict[str, Any]]:
        response = self.get("/me/providers", account.session)
        assert response.status_code == 200, response.text
        return list(response.json()["data"])

    def wait_listed(self, account: Account, session_id: str, timeout: float = 30) -> None:
        """Until the consumer side lists the account's machine online with this session (with
        replicas, once the machine's replica announced it)."""
        wait_until(lambda: any(m["session_id"] == session_id and m["online"] for m in self.machines(account)),
                   timeout=timeout, interval=0.05, what=f"{session_id} listed online")

    def machine_of(self, account: Account, session_id: str) -> str:
        """The `mach_…` id of the account's machine whose live session is ``session_id``."""
        for machine in self.machines(account):
            if machine["session_id"] == session_id:
                return str(machine["id"])
        raise AssertionError(f"{session_id} is not a live session of {account.account_id}")

    def pockets(self) -> dict[str, tuple[int, int]]:
        """Every account's (balance, withdrawable), the platform account included, from the database."""
        rows = self._query("SELECT id, balance_micro_usd, withdrawable_micro_usd FROM accounts")
        return {row[0]: (int(row[1]), int(row[2])) for row in rows}

    def ledger(self, request_id: str) -> list[tuple[str, str, str, int]]:
        """The ledger entries of one request: (account, kind, pocket, amount), in order."""
        rows = self._query("SELECT account_id, kind, pocket, amount_micro_usd FROM ledger_entries "
                           "WHERE request_id = ? ORDER BY id", request_id)
        return [(str(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]

    def _query(self, sql: str, *params: object) -> list[Any]:
        url = self.coordinator.database_url
        if url.startswith("sqlite"):
            with sqlite3.connect(url.split("///", 1)[1]) as db:
                return db.execute(sql, params).fetchall()

        async def fetch() -> list[Any]:
            import asyncpg

            numbered = re.sub(r"\?", lambda _m, n=iter(range(1, 100)): f"${next(n)}", sql)
            conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
            try:
                return list(await conn.fetch(numbered, *params))
            finally:
                await conn.close()
        return asyncio.run(fetch())

    def platform_withdrawable(self) -> int:
        return self.pockets().get(PLATFORM_ACCOUNT_ID, (0, 0))[1]


def wait_accepted(node: Node, future: Any, timeout: float = 30) -> str:
    """The id of the first request ``node`` accepted; fails at once if ``future`` (the request) ends first."""
    def seen() -> str | None:
        if node.accepted():
            return node.accepted()[0]
        if future.done():
            response = future.result()
            raise AssertionError(f"the request ended before the node accepted it: {response.status_code} "
                                 f"{response.text}")
        return None
    return str(wait_until(seen, timeout=timeout, interval=0.05, what="the request on the node"))


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body (JSON-decoded; `[DONE]` kept as the string)."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def streamed_text(text: str) -> str:
    return "".join(choice["delta"].get("content") or "" for event in sse_events(text) if isinstance(event, dict)
                   for choice in event.get("choices", []))


def error_of(response: httpx.Response) -> dict[str, Any]:
    return dict(response.json()["error"])

