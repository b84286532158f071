"""A real node (llama.cpp, bundled model) with direct mode beside fleet serving, against the fake
coordinator WebSocket endpoint of the provider tests: one concurrency limit for both sides,
`local.json` while serving, and `local_only` never dialling a coordinator."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from darkbloom import paths
from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.provider.config import load_config
from darkbloom.provider.node import ProviderNode
from tests.provider.fake_coordinator import Conn, FakeCoordinator

LONG = {"model": "smollm2-135m", "stream": True, "max_tokens": 400, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]}


async def run_node(home: Path, coordinator_url: str, local_only: bool) -> tuple[ProviderNode, asyncio.Event,
                                                                                    asyncio.Task[None]]:
    paths.auth_token_path(home).write_text("dkp-test-token\n")
    config = load_config(home, {"coordinator_url": coordinator_url, "max_concurrency": 1,
                                "local_endpoint": True, "local_port": 0})
    config.heartbeat_interval_secs = 0.2
    config.context_length = 1024
    node = ProviderNode(config, home, local_only=local_only)
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    while not paths.local_discovery_path(home).exists():  # bounded by the test timeout
        assert not task.done(), task.exception()
        await asyncio.sleep(0.02)
    return node, stop, task


def discovery(home: Path) -> dict[str, object]:
    return json.loads(paths.local_discovery_path(home).read_text())


async def heartbeat(conn: Conn) -> protocol.Heartbeat:
    while not isinstance(frame := await conn.recv(), protocol.Heartbeat):
        pass
    return frame


@pytest.fixture
async def fake() -> AsyncIterator[FakeCoordinator]:
    async with FakeCoordinator() as coordinator:
        yield coordinator


async def test_fleet_and_direct_requests_share_one_max_concurrency(home: Path, fake: FakeCoordinator) -> None:
    node, stop, task = await run_node(home, fake.url, local_only=False)
    try:
        conn = await fake.accept()
        register = await conn.recv()
        assert isinstance(register, protocol.Register) and register.max_concurrency == 1
        await conn.send(protocol.Registered(provider_id="prov_d", account_id="acct_d", trust_level="self_signed"))
        found = discovery(home)
        assert found == {"base_url": f"http://127.0.0.1:{found['port']}/v1", "api_key": found["api_key"],
                         "host": "127.0.0.1", "port": found["port"], "pid": os.getpid()}
        assert str(found["api_key"]).startswith("dk-local-")
        assert found["api_key"] == paths.local_token_path(home).read_text().strip()
        for path in (paths.local_token_path(home), paths.local_discovery_path(home)):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        state = json.loads(paths.node_state_path(home).read_text())
        assert state["local_url"] == found["base_url"] and state["local_only"] is False

        reply = crypto.ReplyKey()
        body = json.dumps({**LONG, "max_tokens": 8}).encode()
        headers = {"Authorization": f"Bearer {found['api_key']}"}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{found['base_url']}/chat/completions", json=LONG,
                                   headers=headers) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                # the direct stream holds the only slot: the fleet is refused, heartbeats say busy
                envelope = reply.seal_request(body, crypto.public_key_from_b64(register.public_key))
                await conn.send(protocol.InferenceRequest(request_id="req_fleet", encrypted_body=envelope))
                refused = await conn.recv_type(protocol.InferenceError)
                assert (refused.request_id, refused.status_code) == ("req_fleet", 429)
                beat = await heartbeat(conn)
                assert (beat.status, beat.active_requests) == ("busy", 1)
            # the client went away: generation stops and the slot comes back
            while node.slots.active:  # bounded by the test timeout
                await asyncio.sleep(0.02)
            envelope = reply.seal_request(body, crypto.public_key_from_b64(register.public_key))
            await conn.send(protocol.InferenceRequest(request_id="req_fleet_2", encrypted_body=envelope))
            assert (await conn.recv_type(protocol.InferenceAccepted)).request_id == "req_fleet_2"
            # and a direct request now waits for the fleet request instead of failing
            direct = await http.post(f"{found['base_url']}/chat/completions", headers=headers,
                                     json={**LONG, "stream": False, "max_tokens": 4})
            assert direct.status_code == 200 and direct.json()["usage"]["completion_tokens"] <= 4
            while not isinstance(frame := await conn.recv(), protocol.InferenceComplete):
                pass
            assert frame.request_id == "req_fleet_2"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert not paths.local_discovery_path(home).exists()
    assert json.loads(paths.node_state_path(home).read_text())["local_url"] is None


async def test_local_only_never_dials_the_coordinator(home: Path, fake: FakeCoordinator) -> None:
    node, stop, task = await run_node(home, fake.url, local_only=True)
    try:
        found = discovery(home)
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(f"{found['base_url']}/chat/completions",
                                       headers={"Authorization": f"Bearer {found['api_key']}"},
                                       json={**LONG, "stream": False, "max_tokens": 4})
        assert response.status_code == 200
        state = json.loads(paths.node_state_path(home).read_text())
        assert state["local_only"] is True and state["connected"] is False
        token = found["api_key"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    # a node that connects dials as soon as its local endpoint is up, so it would have reached the
    # fake coordinator while the request above was served; and a stopped node dials no more
    assert fake.connections.empty() and fake.paths == []
    assert not paths.local_discovery_path(home).exists()
    # the token is kept and reused by the next run
    node, stop, task = await run_node(home, fake.url, local_only=True)
    try:
        assert discovery(home)["api_key"] == token
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_taken_port_fails_before_the_model_loads(home: Path) -> None:
    import socket

    from darkbloom.provider.direct.endpoint import LocalEndpointError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = load_config(home, {"local_endpoint": True, "local_port": port})
        node = ProviderNode(config, home, local_only=True)
        with pytest.raises(LocalEndpointError, match=f"port {port} .* already in use"):
            await node.run(asyncio.Event())
    assert not paths.local_discovery_path(home).exists()


async def test_no_token_file_no_direct_mode(home: Path) -> None:
    from darkbloom.provider.direct.endpoint import LocalEndpointError

    paths.local_token_path(home).mkdir()  # the token file cannot be created
    config = load_config(home, {"local_endpoint": True, "local_port": 0, "local_bind": "0.0.0.0"})
    node = ProviderNode(config, home, local_only=True)
    with pytest.raises(LocalEndpointError, match="refusing to serve direct mode without its token.*0.0.0.0"):
        await node.run(asyncio.Event())
