"""Direct-first end to end: a real coordinator, a real linked node (bundled model), the official
`openai` SDK through `darkbloom.client`, and `darkbloom chat --local-first`.

"The node's local endpoint stopped but the node still connected": the node is stopped and started
again on the same `$DARKBLOOM_HOME` (same machine, same device token) without `--local-endpoint`,
and the client keeps the endpoint it was given — so its connection is refused while the machine is
online at the coordinator, and the request must go through Self-Route.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from darkbloom.client import async_direct_first_openai, direct_first_openai
from darkbloom.wire.local_files import Discovery, write_discovery
from tests.provider.direct.support import (MODEL, SHORT, docs_snippet, run_chat, run_python, usage_rows,
                                  wait_discovery)
from tests.support.accounts import Account, balance, create_account, login_node, online_sessions
from tests.support.processes import Coordinator, Process, node_cmd, spawn, start_coordinator, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("direct-e2e")
    coordinator = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}")
    try:
        yield coordinator
    finally:
        coordinator.stop()


def start_node(coord: Coordinator, home: Path, *args: str, direct_fail: int | None = None) -> Process:
    return spawn(node_cmd("serve", "--coordinator", coord.base_url, *args, direct_fail=direct_fail), home, "node.log")


def wait_new_session(coord: Coordinator, owner: Account, previous: str | None = None) -> str:
    def online() -> str | None:
        sessions = [m["session_id"] for m in online_sessions(coord, owner)]
        return sessions[0] if len(sessions) == 1 and sessions[0] != previous else None
    return str(wait_until(online, timeout=120, interval=0.2, what="the node online with a new session"))


def test_via_local_then_via_coordinator_once_the_local_endpoint_stops(coord: Coordinator, tmp_path: Path) -> None:
    owner = create_account(coord)  # zero balance: only free self-routed requests can succeed
    home = tmp_path / "node"
    login_node(coord, home, owner)
    node = start_node(coord, home, "--local-endpoint", "--port", "0")
    try:
        session = wait_new_session(coord, owner)
        found = wait_discovery(home)
        client = direct_first_openai(coord.base_url, owner.api_key, home=home, max_retries=0)  # via local.json
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=SHORT, max_tokens=16)
        assert raw.headers["X-Darkbloom-Via"] == "local" and "X-Provider-Id" not in raw.headers
        completion = raw.parse()
        assert completion.choices[0].message.content and 0 < completion.usage.completion_tokens <= 16
        stream = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=16, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert stream.response.headers["X-Darkbloom-Via"] == "local" and text

        async def async_call() -> tuple[str, str]:
            aclient = async_direct_first_openai(coord.base_url, owner.api_key, home=home, max_retries=0)
            astream = await aclient.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=8, stream=True)
            parts = [c.choices[0].delta.content or "" async for c in astream if c.choices]
            await aclient.close()
            return astream.response.headers["X-Darkbloom-Via"], "".join(parts)
        via, text = asyncio.run(async_call())
        assert via == "local" and text

        chat = run_chat(home, "--local-first", "--coordinator", coord.base_url, "--max-tokens", "16",
                        "Name one planet.", env={"DARKBLOOM_API_KEY": owner.api_key})
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip() and chat.stderr.strip().splitlines() == ["via local"]
        assert usage_rows(coord, owner) == []  # direct requests never reach the coordinator
    finally:
        node.stop()
    assert not (home / "local.json").exists()  # removed on a clean stop

    node = start_node(coord, home)  # the same machine, still linked and online, direct mode off
    try:
        wait_new_session(coord, owner, previous=session)
        # the client still has the endpoint it was given; its connection is refused now
        client = direct_first_openai(coord.base_url, owner.api_key, local_url=str(found["base_url"]),
                                     local_token=str(found["api_key"]), max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=SHORT, max_tokens=16)
        assert raw.headers["X-Darkbloom-Via"] == "coordinator"
        assert (raw.headers["X-Darkbloom-Routed"], raw.headers["X-Darkbloom-Billing"]) == ("owned", "free")
        assert raw.parse().choices[0].message.content

        # darkbloom chat, with a local.json whose node is alive but whose endpoint is gone
        client_home = tmp_path / "client"
        client_home.mkdir()
        write_discovery(client_home, Discovery(base_url=str(found["base_url"]), api_key=str(found["api_key"]),
                                               host="127.0.0.1", port=int(str(found["port"])), pid=os.getpid()))
        chat = run_chat(client_home, "--local-first", "--coordinator", coord.base_url, "--max-tokens", "16",
                        "Name one planet.", env={"DARKBLOOM_API_KEY": owner.api_key})
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip() and chat.stderr.strip().splitlines() == ["via coordinator"]

        # the docs snippet, with no local endpoint at all: Self-Route
        snippet = run_python(docs_snippet(), home, {"DARKBLOOM_COORDINATOR": coord.base_url,
                                                    "DARKBLOOM_API_KEY": owner.api_key})
        assert snippet.returncode == 0, snippet.stderr
        assert snippet.stdout.splitlines()[0] == "via coordinator"

        rows = wait_until(lambda: (r := usage_rows(coord, owner)) and len(r) >= 4 and r, timeout=30,
                          what="4 usage rows")
        assert len(rows) == 4
        assert all(r["cost_micro_usd"] == 0 and r["self_routed"] is True and r["routed"] == "owned" for r in rows)
        assert balance(coord, owner) == 0
    finally:
        node.stop()


def test_a_local_500_is_the_answer_and_is_not_rerouted(coord: Coordinator, tmp_path: Path) -> None:
    owner = create_account(coord)
    home = tmp_path / "node"
    login_node(coord, home, owner)
    # direct mode runs on a backend that answers 500 (tests/support/backends.py); fleet requests on the real one
    node = start_node(coord, home, "--local-endpoint", "--port", "0", direct_fail=500)
    try:
        wait_new_session(coord, owner)
        wait_discovery(home)
        client = direct_first_openai(coord.base_url, owner.api_key, home=home, max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as failure:
                client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=8, stream=stream)
            assert failure.value.status_code == 500
            assert failure.value.response.headers["X-Darkbloom-Via"] == "local"
            assert failure.value.code == "server_error" and "test hook" in failure.value.message
        chat = run_chat(home, "--local-first", "--coordinator", coord.base_url, "Name one planet.",
                        env={"DARKBLOOM_API_KEY": owner.api_key})
        assert chat.returncode == 1 and chat.stdout == ""
        assert chat.stderr.splitlines()[0] == "via local" and "test hook" in chat.stderr and "500" in chat.stderr
        assert usage_rows(coord, owner) == []  # the coordinator never saw those requests
        # ... although it would have served them: the same request through Self-Route succeeds
        relayed = httpx.post(coord.api_url + "/chat/completions", timeout=60,
                             headers={**owner.headers(), "X-Darkbloom-Route": "self"},
                             json={"model": MODEL, "messages": SHORT, "max_tokens": 8})
        assert relayed.status_code == 200, relayed.text
        assert len(usage_rows(coord, owner)) == 1
    finally:
        node.stop()
