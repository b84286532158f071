"""Two replicas on one Postgres, Redis and NATS are one coordinator: provider sockets connect to
replica A, consumers call replica B, and every request is served across the NATS hop — paid and
self-routed, streamed and not, with Self-Route's views and pre-flight errors as if the machine were
connected to B, a cancel that reaches the node through A, and a queue on B drained when A's slot
frees."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support.accounts import Account, balance, create_account, device_token
from tests.support.processes import Coordinator, wait_until
from tests.support.raw_provider import ThreadedRaw
from tests.support.replicas import Replicas, readyz, replica_set

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16}
SELF = {"X-Darkbloom-Route": "self"}
REMOTE_REQUESTS = "darkbloom_fabric_remote_requests_total"  # attempts sent to another replica's session


@dataclass
class World:
    replicas: Replicas
    a: Coordinator
    b: Coordinator
    raws: list[ThreadedRaw]

    def raw(self, owner: Account | None, answer: str | None = "served", **options: Any) -> ThreadedRaw:
        token = device_token(self.a, owner) if owner is not None else None
        raw = ThreadedRaw(self.a.base_url, token, answer=answer, **options)
        self.raws.append(raw)
        return raw


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("replicas")
    with replica_set(root, 2, "--queue-max-wait", "20") as replicas:
        w = World(replicas, replicas.coordinators[0], replicas.coordinators[1], [])
        try:
            yield w
        finally:
            for raw in w.raws:
                raw.close()


def chat(coord: Coordinator, token: str, headers: dict[str, str] | None = None, **fields: object) -> httpx.Response:
    return httpx.post(coord.api_url + "/chat/completions", json={**BODY, **fields},
                      headers={"Authorization": f"Bearer {token}", **(headers or {})}, timeout=60)


def stream(coord: Coordinator, token: str, headers: dict[str, str] | None = None) -> tuple[httpx.Response, str]:
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", coord.api_url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {token}", **(headers or {})}) as response:
        return response, response.read().decode()


def get(coord: Coordinator, path: str, token: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(coord.api_url + path, headers={"Authorization": f"Bearer {token}", **(headers or {})},
                     timeout=30)


def visible_on(coord: Coordinator, account: Account, session_id: str) -> bool:
    machines = get(coord, "/me/providers", account.session).json()["data"]
    return any(m["online"] and m["session_id"] == session_id for m in machines)


def usage(coord: Coordinator, account: Account) -> list[dict[str, object]]:
    return list(get(coord, "/payments/usage?limit=100", account.session).json()["data"])


def error_of(response: httpx.Response) -> dict[str, object]:
    return dict(response.json()["error"])


def test_replicas_hear_each_other(world: World) -> None:
    for coord in (world.a, world.b):
        ready = readyz(coord)
        assert ready["status"] == "ready" and ready["nats"] == "connected" and ready["replicas"] == 2
    metrics = httpx.get(world.b.base_url + "/metrics").text
    assert "darkbloom_nats_connected 1.0" in metrics


def test_paid_request_served_through_another_replica(world: World) -> None:
    stranger = create_account(world.a)
    public = world.raw(stranger, answer="from replica A")
    payer = create_account(world.b, credit_micro_usd=10_000_000)
    wait_until(lambda: any(m["id"] == MODEL for m in get(world.b, "/models", payer.api_key).json()["data"]),
               timeout=20, what="the model listed on B")
    crossed = {coord.base_url: coord.metric(REMOTE_REQUESTS) for coord in (world.a, world.b)}
    response = chat(world.b, payer.api_key)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "from replica A"
    assert response.headers["x-provider-id"] == public.session_id
    assert response.headers["x-darkbloom-routed"] == "fleet"
    assert response.headers["x-darkbloom-billing"] == "charged"
    streamed, text = stream(world.b, payer.api_key)
    assert streamed.status_code == 200, text
    assert streamed.headers["x-provider-id"] == public.session_id
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "from replica A" in "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                                       for e in events[:-1] if json.loads(e)["choices"])
    assert set(public.requests) == {response.headers["x-request-id"], streamed.headers["x-request-id"]}
    assert world.b.metric(REMOTE_REQUESTS) - crossed[world.b.base_url] == 2  # both sent to A's session
    assert world.a.metric(REMOTE_REQUESTS) == crossed[world.a.base_url]
    rows = usage(world.a, payer)  # settled by B, read through A: one database
    assert {r["request_id"] for r in rows} == set(public.requests)
    costs = [int(str(r["cost_micro_usd"])) for r in rows]
    assert all(cost > 0 for cost in costs) and all(r["routed"] == "fleet" for r in rows)
    assert balance(world.a, payer) == 10_000_000 - sum(costs)
    earned = get(world.b, "/provider/earnings?limit=10", stranger.session).json()
    assert {e["request_id"] for e in earned["data"]} == set(public.requests)


def test_exclusive_self_route_free_at_zero_balance_across_replicas(world: World) -> None:
    owner = create_account(world.b)  # no credit at all
    machine = world.raw(owner, answer="from your own machine")
    wait_until(lambda: visible_on(world.b, owner, machine.session_id), timeout=20, what="the machine on B")
    assert get(world.b, "/me/self-route-models", owner.api_key).json() == {"models": [MODEL]}
    listed = get(world.b, "/models", owner.api_key, SELF).json()["data"]
    assert [m["id"] for m in listed] == [MODEL]
    for streamed in (False, True):
        if streamed:
            response, text = stream(world.b, owner.api_key, SELF)
            assert "from your own machine" in text and text.rstrip().endswith("data: [DONE]")
        else:
            response = chat(world.b, owner.api_key, SELF)
            assert response.json()["choices"][0]["message"]["content"] == "from your own machine"
        assert response.status_code == 200
        assert response.headers["x-provider-id"] == machine.session_id
        assert response.headers["x-darkbloom-routed"] == "owned"
        assert response.headers["x-darkbloom-billing"] == "free"
    rows = usage(world.b, owner)
    assert len(rows) == 2 and all(r["cost_micro_usd"] == 0 and r["self_routed"] for r in rows)
    assert balance(world.b, owner) == 0


def test_preflight_errors_across_replicas(world: World) -> None:
    nobody = create_account(world.b)
    response = chat(world.b, nobody.api_key, SELF)
    assert response.status_code == 409 and error_of(response)["code"] == "no_linked_machine"

    other = create_account(world.b)
    elsewhere = world.raw(other, models=("another-model",))
    wait_until(lambda: visible_on(world.b, other, elsewhere.session_id), timeout=20, what="the machine on B")
    response = chat(world.b, other.api_key, SELF)
    assert response.status_code == 503 and error_of(response)["code"] == "model_not_loaded", response.text
    assert get(world.b, "/me/self-route-models", other.api_key).json() == {"models": ["another-model"]}

    elsewhere.close()  # the node leaves replica A: B no longer sees it online
    wait_until(lambda: not visible_on(world.b, other, elsewhere.session_id), timeout=20, what="offline on B")
    response = chat(world.b, other.api_key, SELF)
    assert response.status_code == 503, response.text
    assert error_of(response)["code"] == "machine_offline" and response.headers["retry-after"] == "30"


def test_cancel_on_client_disconnect_reaches_the_node_through_its_replica(world: World) -> None:
    owner = create_account(world.b)
    machine = world.raw(owner, answer=None)  # answers only when told
    wait_until(lambda: visible_on(world.b, owner, machine.session_id), timeout=20, what="the machine on B")
    def first_line_then_leave() -> str:
        with httpx.stream("POST", world.b.api_url + "/chat/completions", json={**BODY, "stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {owner.api_key}", **SELF}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    return line  # and the connection closes
        return ""

    with ThreadPoolExecutor(1) as pool:
        client = pool.submit(first_line_then_leave)
        request_id = wait_until(lambda: next(iter(machine.requests), None), timeout=20, what="the request on A")
        machine.chunk(request_id, "first words")
        assert "first words" in client.result()
    # the client is gone: B cancels, A passes the cancel to the node's socket
    wait_until(lambda: request_id in machine.cancels, timeout=20, what="the cancel at the node")
    machine.complete(request_id, prompt_tokens=3, completion_tokens=2)  # its partial usage, settled by B
    row = wait_until(lambda: [r for r in usage(world.b, owner) if r["request_id"] == request_id], timeout=20,
                     what="the usage row")[0]
    assert row["completion_tokens"] == 2 and row["cost_micro_usd"] == 0


def test_queue_on_one_replica_drains_when_the_slot_frees_on_another(world: World) -> None:
    owner = create_account(world.b)
    machine = world.raw(owner, answer=None, max_concurrency=1)
    wait_until(lambda: visible_on(world.b, owner, machine.session_id), timeout=20, what="the machine on B")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(chat, world.b, owner.api_key, SELF)
        first_id = wait_until(lambda: next(iter(machine.requests), None), timeout=20, what="the first request")
        second = pool.submit(chat, world.b, owner.api_key, SELF)  # the only slot is taken: it queues on B
        wait_until(lambda: "darkbloom_scheduler" in httpx.get(world.b.base_url + "/metrics").text, timeout=5)
        assert len(machine.requests) == 1
        machine.chunk(first_id, "one")
        machine.complete(first_id)
        assert first.result().status_code == 200
        second_id = wait_until(lambda: [r for r in machine.requests if r != first_id], timeout=20,
                               what="the queued request placed")[0]
        machine.chunk(second_id, "two")
        machine.complete(second_id)
        response = second.result()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "two"


def test_unlink_through_another_replica_mid_flight(world: World) -> None:
    """The machine is unlinked on B while B's request runs on it through A: the request still costs
    0 and pays nobody (its row says ownership_changed), and A closes the node's session once idle."""
    owner = create_account(world.b)
    machine = world.raw(owner, answer=None)
    wait_until(lambda: visible_on(world.b, owner, machine.session_id), timeout=20, what="the machine on B")
    machine_id = next(m["id"] for m in get(world.b, "/me/providers", owner.session).json()["data"]
                      if m["session_id"] == machine.session_id)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(chat, world.b, owner.api_key, SELF)
        request_id = wait_until(lambda: next(iter(machine.requests), None), timeout=20, what="the request on A")
        unlinked = httpx.delete(world.b.api_url + f"/me/providers/{machine_id}",
                                headers={"Authorization": f"Bearer {owner.session}"})
        assert unlinked.status_code in (200, 204), unlinked.text
        machine.chunk(request_id, "still answering")
        machine.complete(request_id)
        response = running.result()
    assert response.status_code == 200, response.text
    assert response.headers["x-darkbloom-billing"] == "free"
    row = next(r for r in usage(world.b, owner) if r["request_id"] == request_id)
    assert row["cost_micro_usd"] == 0 and row.get("ownership_changed") is True
    wait_until(lambda: not machine._thread.is_alive(), timeout=20, what="A closing the unlinked session")
