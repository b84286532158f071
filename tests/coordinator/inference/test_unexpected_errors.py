"""What nothing foresaw still answers in the envelope: an exception raised inside serving is a 500
``server_error`` in the API's JSON envelope with the request's ``X-Request-Id`` (streamed or not),
never Starlette's text/plain; and a session whose registration says an absurd size (one the wire's
bounds now refuse) is served, not a 500 (the load estimate caps the size before dividing it). The
coordinator app runs in the test's event loop, on SQLite."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import httpx
import pytest

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.inference import serving
from darkbloom.coordinator.services import Services
from darkbloom.store import keys
from darkbloom.wire.crypto import new_token, token_hash
from darkbloom.wire.protocol import ModelInfo
from tests.coordinator.money.conftest import new_account
from tests.coordinator.routing.sim import fleet, settings

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def coordinator(database_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, Services]]:
    app = create_app(settings(database_url=database_url, first_content_timeout=10.0))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as a server answers: no re-raise
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator", timeout=30) as http:
            yield http, app.state.services


async def api_key(services: Services) -> dict[str, str]:
    account = await new_account(services, credit=10_000_000)
    token = new_token("dk-")
    async with services.engine.begin() as conn:
        await keys.create(conn, account, token_hash(token), token[:8], {"name": "unexpected"})
    return {"Authorization": f"Bearer {token}"}


def _explode(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("a defect nothing foresaw")


@pytest.mark.parametrize("path,body,prefix", [
    ("/v1/chat/completions", CHAT, "chatcmpl-"),
    ("/v1/chat/completions", {**CHAT, "stream": True}, "chatcmpl-"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "stream": True}, "resp_"),
])
async def test_an_unexpected_exception_in_serving_is_a_500_envelope_with_the_request_id(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any], prefix: str) -> None:
    monkeypatch.setattr(serving, "parse_call", _explode)
    async with coordinator(sqlite_url) as (http, services):
        response = await http.post(path, json=body, headers=await api_key(services))
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"].startswith(prefix)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert (error["type"], error["code"], error["param"]) == ("server_error", "server_error", None)
    assert "defect" not in error["message"]  # the exception's own text stays in the log


async def test_an_unexpected_exception_on_the_messages_api_is_anthropics_envelope(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "parse_call", _explode)
    async with coordinator(sqlite_url) as (http, services):
        response = await http.post("/v1/messages", json=CHAT, headers=await api_key(services))
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"].startswith("msg_")
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "api_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_session_claiming_an_absurd_size_is_served_not_a_500(sqlite_url: str, stream: bool) -> None:
    async with coordinator(sqlite_url) as (http, services):
        provider, = fleet(services.registry, 1, loaded=())  # not loaded: its load is estimated from its size
        [advertised] = provider.session.registration.models
        provider.session.registration.models[0] = ModelInfo.model_construct(  # past the wire's bounds
            **{**advertised.model_dump(), "size_bytes": 10 ** 400})
        request = asyncio.ensure_future(http.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                                                  headers=await api_key(services)))
        inference = await provider.next_request(timeout=10)
        provider.reply(inference.request_id, "hello")
        provider.complete(inference.request_id)
        response = await request
    assert response.status_code == 200, response.text
    assert "hello" in response.text
