"""The direct-first rule as an httpx transport: re-targeting, when it falls back and when it must not.

The inner transport here is `httpx.MockTransport` standing in for the network, so each failure
kind can be produced exactly; the e2e tests run the same transport against real processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import httpx
import pytest

from darkbloom.client import (AsyncDirectFirstTransport, DirectFirstTransport, discover_local_endpoint,
                              direct_first_openai)
from darkbloom.wire.local_files import Discovery, write_discovery

LOCAL = "http://127.0.0.1:8000/v1"
TOKEN = "dk-local-abc"
COORD = "http://coord.example:8080"
KEY = "dk-consumer"


class Network:
    """Records what reached which host; the local host answers, refuses or breaks as told."""

    def __init__(self, local: Callable[[httpx.Request], httpx.Response] | Exception) -> None:
        self.local = local
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if request.url.host == "127.0.0.1":
            if isinstance(self.local, Exception):
                raise self.local
            return self.local(request)
        return httpx.Response(200, json={"from": "coordinator"})


def answer(status: int) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json={"from": "local"})


def sync_client(network: Network, **kwargs: object) -> httpx.Client:
    transport = DirectFirstTransport(COORD, KEY, local_url=LOCAL, local_token=TOKEN,
                                     transport=httpx.MockTransport(network), **kwargs)  # type: ignore[arg-type]
    return httpx.Client(transport=transport, base_url=COORD + "/v1")


def test_local_first_with_its_token_on_the_same_path() -> None:
    network = Network(answer(200))
    with sync_client(network) as client:
        response = client.post("/chat/completions?x=1", json={"model": "m"},
                               headers={"Authorization": f"Bearer {KEY}", "X-Darkbloom-Route": "prefer"})
    assert response.json() == {"from": "local"} and response.headers["X-Darkbloom-Via"] == "local"
    [sent] = network.seen
    assert str(sent.url) == "http://127.0.0.1:8000/v1/chat/completions?x=1"
    assert sent.headers["authorization"] == f"Bearer {TOKEN}" and sent.headers["host"] == "127.0.0.1:8000"
    assert "x-darkbloom-route" not in sent.headers
    assert json.loads(sent.content) == {"model": "m"}


@pytest.mark.parametrize("failure", [httpx.ConnectError("Connection refused"), httpx.ConnectTimeout("timed out"),
                                     httpx.ConnectError("[Errno -2] Name or service not known")])
def test_a_connection_failure_falls_back_to_self_route(failure: Exception) -> None:
    network = Network(failure)
    with sync_client(network) as client:
        response = client.post("/chat/completions", json={"model": "m"}, headers={"Authorization": "Bearer x"})
    assert response.json() == {"from": "coordinator"} and response.headers["X-Darkbloom-Via"] == "coordinator"
    local, coordinator = network.seen
    assert local.url.host == "127.0.0.1"
    assert str(coordinator.url) == COORD + "/v1/chat/completions"
    assert coordinator.headers["authorization"] == f"Bearer {KEY}"
    assert coordinator.headers["x-darkbloom-route"] == "self" and coordinator.headers["host"] == "coord.example:8080"
    assert json.loads(coordinator.content) == {"model": "m"}


@pytest.mark.parametrize("status", [500, 401, 404, 429, 503])
def test_any_http_answer_from_the_local_endpoint_is_the_answer(status: int) -> None:
    network = Network(answer(status))
    with sync_client(network) as client:
        response = client.post("/chat/completions", json={})
    assert response.status_code == status and response.headers["X-Darkbloom-Via"] == "local"
    assert len(network.seen) == 1


@pytest.mark.parametrize("failure", [httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("dropped"),
                                     httpx.ReadError("reset")])
def test_a_failure_after_connecting_is_not_rerouted(failure: Exception) -> None:
    network = Network(failure)
    with sync_client(network) as client, pytest.raises(type(failure)):
        client.post("/chat/completions", json={})
    assert len(network.seen) == 1  # the request may have run on the node: never sent twice


def test_the_local_connect_timeout_is_short() -> None:
    network = Network(answer(200))
    with sync_client(network, local_connect_timeout=1.5) as client:
        client.get("/models", timeout=60)
    assert network.seen[0].extensions["timeout"]["connect"] == 1.5


def test_without_a_coordinator_a_local_failure_is_raised() -> None:
    transport = DirectFirstTransport(local_url=LOCAL, local_token=TOKEN,
                                     transport=httpx.MockTransport(Network(httpx.ConnectError("refused"))))
    with httpx.Client(transport=transport) as client, pytest.raises(httpx.ConnectError, match="no coordinator"):
        client.get(LOCAL + "/models")


def test_a_local_url_needs_its_token() -> None:
    with pytest.raises(ValueError, match="local_token"):
        DirectFirstTransport(COORD, KEY, local_url=LOCAL)


def test_discovery_reads_local_json_per_request_and_skips_a_dead_node(tmp_path: Path) -> None:
    network = Network(answer(200))
    transport = DirectFirstTransport(COORD, KEY, home=tmp_path, transport=httpx.MockTransport(network))
    with httpx.Client(transport=transport, base_url=COORD + "/v1") as client:
        assert client.get("/models").headers["X-Darkbloom-Via"] == "coordinator"  # no local.json yet
        write_discovery(tmp_path, Discovery(base_url="http://127.0.0.1:8123/v1", api_key="dk-local-found",
                                            host="127.0.0.1", port=8123, pid=os.getpid()))
        assert client.get("/models").headers["X-Darkbloom-Via"] == "local"  # picked up without a restart
        assert str(network.seen[-1].url) == "http://127.0.0.1:8123/v1/models"
        assert network.seen[-1].headers["authorization"] == "Bearer dk-local-found"
        write_discovery(tmp_path, Discovery(base_url="http://127.0.0.1:8123/v1", api_key="dk-local-found",
                                            host="127.0.0.1", port=8123, pid=2**22 + 12345))  # no such process
        assert discover_local_endpoint(tmp_path) is None
        assert client.get("/models").headers["X-Darkbloom-Via"] == "coordinator"


async def test_the_async_transport_follows_the_same_rule() -> None:
    for local, via, count in ((answer(500), "local", 1), (httpx.ConnectError("refused"), "coordinator", 2)):
        network = Network(local)
        transport = AsyncDirectFirstTransport(COORD, KEY, local_url=LOCAL, local_token=TOKEN,
                                              transport=httpx.MockTransport(network))
        async with httpx.AsyncClient(transport=transport, base_url=COORD + "/v1") as client:
            response = await client.post("/chat/completions", json={"model": "m"})
        assert response.headers["X-Darkbloom-Via"] == via and len(network.seen) == count
        assert json.loads(network.seen[-1].content) == {"model": "m"}


def test_the_openai_helper_routes_through_the_transport(tmp_path: Path) -> None:
    client = direct_first_openai(COORD, KEY, local_url="http://127.0.0.1:1/v1", local_token=TOKEN, max_retries=0)
    assert str(client.base_url) == COORD + "/v1/"
    assert isinstance(client._client._transport, DirectFirstTransport)  # noqa: SLF001
