"""One provider session, traced: the files a reader follows it through are those docs/architecture.md
lists under "One provider session, file by file", in that order, at most eight of them, with at most
four returns to a file already left (``tests/support/call_trace.py`` says what counts).

The session is a real one, driven in-process over a real socket: a linked machine's node registers,
answers the first challenge and is registered, sends a heartbeat, serves one paid chat request (a
chunk and its completion delivered to the attempt), is distrusted for a chunk that does not open in
the next one, and closes."""

from __future__ import annotations

import asyncio
import re
import secrets
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
from nacl.public import PrivateKey

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.server import build_server
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import Sealer
from darkbloom.wire.protocol import InferenceResponseChunk, TrustStatus, dump
from tests.support.call_trace import CallTrace
from tests.support.processes import ADMIN_TOKEN
from tests.support.raw_provider import RawProvider

ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"
ROOTS = ("http/routes/provider_ws.py", "fleet/connection.py")
MAX_FILES = 8
MAX_RETURNS = 4
MODEL = "walk-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def documented_walk() -> list[str]:
    """The files of the numbered list under "One provider session, file by file", in order."""
    text = ARCHITECTURE.read_text()
    section = text.split("### One provider session, file by file", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.MULTILINE)


class InProcess:
    """The coordinator's app served by uvicorn on this test's own event loop, so that one trace sees
    the socket route, the session and the request alike."""

    def __init__(self, database: Path) -> None:
        self.settings = CoordinatorSettings(host="127.0.0.1", port=0, admin_token=ADMIN_TOKEN,
                                            min_trust="self_signed", database_url=f"sqlite+aiosqlite:///{database}")
        self.server = build_server(self.settings, log_level="warning", own_signals=False)
        self.listening = self.server.config.bind_socket()
        self.base_url = f"http://127.0.0.1:{self.listening.getsockname()[1]}"
        self.task: asyncio.Task[None] | None = None

    @property
    def services(self) -> Services:
        services: Services = self.server.config.app.state.services
        return services

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.listening]))
        while not self.server.started:
            assert not self.task.done(), "the in-process coordinator did not start"
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.wait_for(self.task, 30)
        self.listening.close()


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[InProcess]:
    coordinator = InProcess(tmp_path / "coordinator.db")
    await coordinator.start()
    try:
        yield coordinator
    finally:
        await coordinator.stop()


async def signed_up(client: httpx.AsyncClient) -> dict[str, Any]:
    signup = await client.post("/v1/auth/signup", json={"email": f"walk-{secrets.token_hex(4)}@example.com",
                                                          "password": "correct horse 1"})
    signup.raise_for_status()
    return dict(signup.json())


async def paying_key(client: httpx.AsyncClient) -> str:
    """A consumer's API key with credit, for a model of the catalog nobody else serves."""
    account = await signed_up(client)
    key = await client.post("/v1/keys", json={"name": "walk"}, headers={"Authorization": f"Bearer {account['token']}"})
    key.raise_for_status()
    credit = await client.post("/v1/admin/credit", headers=ADMIN, json={
        "account_id": account["account_id"], "amount_micro_usd": 10_000_000, "reference": "walk"})
    credit.raise_for_status()
    catalog = (await client.get("/v1/admin/catalog", headers=ADMIN)).json()
    catalog["models"].append({"id": MODEL, "input_price": 1_000, "output_price": 1_000})
    (await client.put("/v1/admin/catalog", json=catalog, headers=ADMIN)).raise_for_status()
    return str(key.json()["key"])


async def device_token(client: httpx.AsyncClient) -> str:
    """A machine linked to an owner account through the device flow: its node's ``dkp-`` token."""
    owner = await signed_up(client)
    code = (await client.post("/v1/device/code")).json()
    approved = await client.post("/v1/device/approve", json={"user_code": code["user_code"]},
                                 headers={"Authorization": f"Bearer {owner['token']}"})
    approved.raise_for_status()
    token = (await client.post("/v1/device/token", json={"device_code": code["device_code"]})).json()
    return str(token["token"])


def chat(client: httpx.AsyncClient, key: str) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                           json={"model": MODEL, "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": "hello"}]}))


async def one_session(coordinator: InProcess, token: str, key: str, client: httpx.AsyncClient) -> None:
    """Register, first challenge, registered, a heartbeat, a request served, a distrust, close."""
    raw = RawProvider(coordinator.base_url, auth_token=token, models=(MODEL,))
    registered = await asyncio.wait_for(raw.register(), 10)
    assert raw.ws is not None
    await raw.ws.send(dump(raw.heartbeat()))

    served = chat(client, key)
    request, _ = await asyncio.wait_for(raw.next_request(), 10)
    await raw.answer(request, "hi")
    response = await asyncio.wait_for(served, 10)
    assert response.status_code == 200, response.text

    refused = chat(client, key)
    request, _ = await asyncio.wait_for(raw.next_request(), 10)
    wrong_key = Sealer.between(PrivateKey.generate(), request.encrypted_body.ephemeral_public_key)
    await raw.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                  encrypted_data=wrong_key.seal(b"{}"))))
    status = await asyncio.wait_for(raw.recv_until(TrustStatus), 10)
    assert status.trust_level == "untrusted"
    assert (await asyncio.wait_for(refused, 10)).status_code == 502

    await raw.close()
    registry = coordinator.services.registry
    while registry.get(registered["provider_id"]) is not None:
        await asyncio.sleep(0.01)


async def test_a_provider_session_is_read_in_the_files_the_architecture_page_lists(coordinator: InProcess) -> None:
    async with httpx.AsyncClient(base_url=coordinator.base_url, timeout=30) as client:
        key, token = await paying_key(client), await device_token(client)
        with CallTrace() as trace:
            await one_session(coordinator, token, key, client)
    spine = trace.spine(*ROOTS)
    assert list(spine.files) == documented_walk(), spine.files
    assert len(spine.files) <= MAX_FILES, spine.files
    assert len(spine.returns) <= MAX_RETURNS, sorted(spine.returns)
