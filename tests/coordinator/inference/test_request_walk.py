"""docs/architecture.md's "One chat request, file by file" is the walk a paid chat request takes: a real
coordinator (uvicorn on a real socket, SQLite) in the test's event loop, a provider on a real
WebSocket, a paid chat — JSON and streamed — traced with ``sys.setprofile``
(``tests/support/call_trace.py``). The files the route and ``serve`` enter are the page's numbered
list, in its order, and a file of the walk enters another one of it only where the page says so."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.server import build_server
from darkbloom.coordinator.services import Services
from darkbloom.store import keys
from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from darkbloom.wire.crypto import new_token, token_hash
from tests.coordinator.money.conftest import new_account
from tests.support.call_trace import CallTrace, Spine
from tests.support.raw_provider import RawProvider

ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"
WALK_HEADING = "### One chat request, file by file"
ROOTS = ("http/routes/inference.py", "inference/serving.py")
MOST_FILES = 8


class PageWalk:
    """The walk as the page states it: its numbered files in order, how many returns it counts, and
    the returns it names (`` `from.py` → `to.py` ``)."""

    def __init__(self) -> None:
        section = ARCHITECTURE.read_text().split(WALK_HEADING, 1)[1].split("\n### ", 1)[0]
        self.files = tuple(re.findall(r"^\d+\. `([^`]+\.py)`", section, re.MULTILINE))
        stated = re.search(r"(\d+|no) returns? to a file already left", section)
        assert stated is not None, "the walk's section says how many returns it has"
        self.returns = 0 if stated.group(1) == "no" else int(stated.group(1))
        self.named = set(re.findall(r"`([^`]+\.py)` →\s+`([^`]+\.py)`", section))


@contextlib.asynccontextmanager
async def coordinator(database_url: str) -> AsyncIterator[tuple[str, Services]]:
    settings = CoordinatorSettings(host="127.0.0.1", port=0, database_url=database_url, min_trust="self_signed")
    server = build_server(settings, log_level="warning", own_signals=False)
    listening = server.config.bind_socket()
    task = asyncio.create_task(server.serve(sockets=[listening]))
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
        services: Services = server.config.app.state.services
        yield f"http://127.0.0.1:{listening.getsockname()[1]}", services
    finally:
        server.should_exit = True
        await task


async def api_key(services: Services) -> dict[str, str]:
    account = await new_account(services, credit=10_000_000)
    token = new_token("dk-")
    async with services.engine.begin() as conn:
        await keys.create(conn, account, token_hash(token), token[:8], {"name": "walk"})
    return {"Authorization": f"Bearer {token}"}


async def answer_every_request(provider: RawProvider) -> None:
    while True:
        frame, _body = await provider.next_request()
        await provider.answer(frame, "hello")


async def chat(http: httpx.AsyncClient, headers: dict[str, str], stream: bool) -> httpx.Response:
    body: dict[str, Any] = {"model": BUNDLED_MODEL_ID, "max_tokens": 8, "stream": stream,
                            "messages": [{"role": "user", "content": "hi"}]}
    response = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["x-darkbloom-billing"] == "charged" and "hello" in response.text
    return response


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
async def test_a_paid_chat_walks_the_files_the_architecture_page_lists(sqlite_url: str, stream: bool) -> None:
    async with coordinator(sqlite_url) as (base_url, services):
        provider = RawProvider(base_url)
        await provider.register()
        answering = asyncio.create_task(answer_every_request(provider))
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
                headers = await api_key(services)
                await chat(http, headers, stream)  # the first request of a process warms what is made once
                with CallTrace() as trace:
                    await chat(http, headers, stream)
        finally:
            answering.cancel()
            await provider.close()
    spine = Spine.of(trace.entries, ROOTS)
    page = PageWalk()
    assert spine.files == page.files
    assert len(spine.files) <= MOST_FILES
    assert len(spine.returns) <= page.returns, sorted(spine.returns)
    assert spine.returns <= page.named, sorted(spine.returns - page.named)
