"""Protocol robustness and failure handling on the provider socket, against a real coordinator."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from darkbloom.wire.protocol import MAX_FRAME_BYTES
from tests.e2e.conftest import Stack
from tests.support.raw_provider import RawProvider

pytestmark = pytest.mark.e2e

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 4}


async def _error_frame(ws) -> dict:  # type: ignore[no-untyped-def]
    frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert frame["type"] == "error"
    return frame


async def test_bad_frames_get_error_frames_then_1008(stack: Stack) -> None:
    raw = RawProvider(stack.coordinator.base_url, models=("raw-bad-frames-model",))
    ws = await raw.connect()
    await raw.register()
    await ws.send("{not json")
    assert (await _error_frame(ws))["code"] == "malformed_frame"
    await ws.send(json.dumps({"type": "heartbeat", "padding": "x" * (MAX_FRAME_BYTES + 10)}))
    assert (await _error_frame(ws))["code"] == "frame_too_large"

    # the coordinator keeps serving other providers meanwhile
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(stack.coordinator.api_url + "/chat/completions", json=CHAT,
                                   headers=stack.owner.headers())
    assert response.status_code == 200, response.text

    await ws.send(json.dumps({"type": "teleport"}))
    assert (await _error_frame(ws))["code"] == "unknown_type"
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_first_frame_must_be_register(stack: Stack) -> None:
    raw = RawProvider(stack.coordinator.base_url, models=("raw-unregistered-model",))
    ws = await raw.connect()
    for _ in range(3):
        await ws.send(json.dumps({"type": "heartbeat"}))
        assert (await _error_frame(ws))["code"] == "not_registered"
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_invalid_token_registers_unowned(stack: Stack) -> None:
    raw = RawProvider(stack.coordinator.base_url, auth_token="dkp-forged-token", models=("raw-only-model",))
    registered = await raw.register()
    assert registered["account_id"] is None and registered["provider_id"].startswith("prov_")
    async with httpx.AsyncClient() as http:
        machines = (await http.get(stack.coordinator.api_url + "/me/providers",
                                   headers=stack.owner.headers())).json()["data"]
    assert registered["provider_id"] not in [m["session_id"] for m in machines]
    await raw.close()


async def test_provider_vanishing_before_first_content_is_a_json_5xx(stack: Stack) -> None:
    raw = RawProvider(stack.coordinator.base_url, models=("vanishing-model",))
    await raw.register()
    catalog = (await _admin_get(stack, "/admin/catalog"))
    catalog["models"].append({"id": "vanishing-model", "input_price": 1, "output_price": 1})
    await _admin_put(stack, "/admin/catalog", catalog)
    async with httpx.AsyncClient(timeout=60) as http:
        request = asyncio.create_task(http.post(
            stack.coordinator.api_url + "/chat/completions", headers=stack.owner.headers(),
            json={**CHAT, "model": "vanishing-model", "stream": True}))
        inference, body = await raw.next_request()
        assert body["model"] == "vanishing-model" and body["messages"] == CHAT["messages"]
        await raw.close()
        response = await request
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == "provider_unavailable"


async def _admin_get(stack: Stack, path: str) -> dict:  # type: ignore[type-arg]
    async with httpx.AsyncClient() as http:
        response = await http.get(stack.coordinator.api_url + path, headers=stack.coordinator.admin())
    response.raise_for_status()
    return response.json()


async def _admin_put(stack: Stack, path: str, body: dict) -> None:  # type: ignore[type-arg]
    async with httpx.AsyncClient() as http:
        response = await http.put(stack.coordinator.api_url + path, json=body, headers=stack.coordinator.admin())
    response.raise_for_status()
