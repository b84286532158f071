"""Replica faults: a replica SIGKILLed (its sessions leave the others' view, the requests served
through it fail over or end with the in-band error and are refunded, its node reconnects to another
replica), and NATS unreachable at start or going away (the replica says so and keeps serving its own
sessions; when NATS is back it rejoins)."""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.coordinator.fabric.test_remote_dispatch import BODY, MODEL, SELF, chat, get, visible_on
from tests.support.accounts import balance, create_account, device_token
from tests.support.processes import Coordinator, darkbloom_cmd, free_port, spawn, wait_until
from tests.support.raw_provider import ThreadedRaw
from tests.support.replicas import Replicas, TcpProxy, readyz, replica_set

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    with replica_set(tmp_path, 2) as replicas:
        yield replicas


def port_of(coord: Coordinator) -> int:
    port = urlsplit(coord.base_url).port
    assert port is not None
    return port


def test_replica_killed_its_node_reconnects_to_another(replicas: Replicas, tmp_path: Path) -> None:
    """A real node on the bundled model, connected to replica C through a proxy (a load balancer's
    URL): served from B across the hop; C SIGKILLed: B stops routing to it; the proxy now leads to B
    and the node, reconnecting, is B's own."""
    b = replicas.coordinators[1]
    c = replicas.start(name="doomed")
    replicas.wait_joined()
    owner = create_account(b)
    proxy = TcpProxy(port_of(c))
    home = tmp_path / "node"
    home.mkdir()
    (home / "auth_token").write_text(device_token(b, owner) + "\n")
    os.chmod(home / "auth_token", 0o600)
    node = spawn(darkbloom_cmd("serve", "--coordinator", proxy.url, "--max-concurrency", "1"), home, "node.log")
    try:
        first = wait_until(lambda: re.findall(r"registered as (prov_\w+)", node.log()), timeout=120,
                           interval=0.2, what="the node registered")[0]
        wait_until(lambda: visible_on(b, owner, first), timeout=20, what="the node on B")
        served = chat(b, owner.api_key, SELF, max_tokens=8)
        assert served.status_code == 200, served.text
        assert served.headers["x-provider-id"] == first and served.json()["choices"][0]["message"]["content"]

        replicas.kill(c)
        wait_until(lambda: not visible_on(b, owner, first), timeout=20, what="B dropping the killed replica's node")
        refused = chat(b, owner.api_key, SELF)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "machine_offline", refused.text

        proxy.retarget(port_of(b))  # the load balancer sends the node's next connection to B
        second = wait_until(lambda: [s for s in re.findall(r"registered as (prov_\w+)", node.log()) if s != first],
                            timeout=90, interval=0.2, what="the node registered again")[0]
        wait_until(lambda: visible_on(b, owner, second), timeout=20, what="the node on B")
        again = chat(b, owner.api_key, SELF, max_tokens=8)
        assert again.status_code == 200, again.text
        assert again.headers["x-provider-id"] == second
    finally:
        node.stop()
        proxy.close()


def test_killed_replica_fails_its_requests_on_the_admitting_one(replicas: Replicas) -> None:
    """Served through C, admitted by B: before first content the request fails over to another
    session; after it, B's stream ends with the error event and the reservation is refunded."""
    b = replicas.coordinators[1]
    c = replicas.start(name="doomed")
    replicas.wait_joined()
    stranger = create_account(b)
    payer = create_account(b, credit_micro_usd=5_000_000)
    a = replicas.coordinators[0]
    spare = ThreadedRaw(a.base_url, device_token(a, stranger), answer=None)
    doomed: ThreadedRaw | None = None
    started = threading.Event()

    def streamed() -> str:
        with httpx.stream("POST", b.api_url + "/chat/completions", json={**BODY, "stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {payer.api_key}"}) as response:
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                started.set()  # the first content reached the client
            return "\n".join(lines)

    try:
        wait_until(lambda: visible_on(b, stranger, spare.session_id), timeout=20, what="the spare on B")
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(chat, b, payer.api_key)  # the spare's only slot, busy until the end
            spare_id = wait_until(lambda: next(iter(spare.requests), None), timeout=20, what="the spare busy")
            doomed = ThreadedRaw(c.base_url, device_token(c, stranger), answer=None)
            wait_until(lambda: visible_on(b, stranger, doomed.session_id), timeout=20, what="the doomed on B")
            client = pool.submit(streamed)
            request_id = wait_until(lambda: next(iter(doomed.requests), None), timeout=20, what="served via C")
            doomed.chunk(request_id, "half an ans")
            assert started.wait(20), "no first content"
            replicas.kill(c)
            text = client.result()
            spare.chunk(spare_id, "done")
            spare.complete(spare_id)
            assert held.result().status_code == 200
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        assert "error" in json.loads(events[-1])
        assert "half an ans" in text
        rows = {r["request_id"]: r for r in get(b, "/payments/usage?limit=10", payer.session).json()["data"]}
        assert request_id not in rows or rows[request_id]["cost_micro_usd"] == 0
        charged = sum(int(r["cost_micro_usd"]) for r in rows.values())
        assert wait_until(lambda: balance(b, payer) == 5_000_000 - charged, timeout=20, what="the refund")
    finally:
        spare.close()
        if doomed is not None:
            doomed.close()


def test_nats_unreachable_at_start_serves_own_sessions(replicas: Replicas) -> None:
    lonely = replicas.start(nats_url=f"nats://127.0.0.1:{free_port()}", name="lonely")
    ready = readyz(lonely)
    assert ready["status"] == "ready" and ready["nats"] == "disconnected", ready
    assert "darkbloom_nats_connected 0.0" in httpx.get(lonely.base_url + "/metrics").text
    owner = create_account(lonely)
    machine = ThreadedRaw(lonely.base_url, device_token(lonely, owner), answer="local")
    try:
        served = chat(lonely, owner.api_key, SELF)
        assert served.status_code == 200 and served.headers["x-provider-id"] == machine.session_id
        b = replicas.coordinators[1]
        assert not visible_on(b, owner, machine.session_id)  # nobody else hears it
    finally:
        machine.close()


def test_nats_going_away_and_coming_back(replicas: Replicas) -> None:
    b = replicas.coordinators[1]
    nats_proxy = TcpProxy(4222)
    cut_off = replicas.start(nats_url=f"nats://127.0.0.1:{nats_proxy.port}", name="cutoff")
    owner = create_account(b)
    machine = ThreadedRaw(cut_off.base_url, device_token(cut_off, owner), answer="from the cut-off replica")
    try:
        wait_until(lambda: visible_on(b, owner, machine.session_id), timeout=20, what="its machine on B")
        nats_proxy.cut()
        wait_until(lambda: readyz(cut_off).get("nats") == "disconnected", timeout=20, what="NATS down said")
        assert readyz(cut_off)["status"] == "ready" and readyz(cut_off)["fabric"] == "out_of_sync"
        local = chat(cut_off, owner.api_key, SELF)
        assert local.status_code == 200 and local.headers["x-provider-id"] == machine.session_id
        wait_until(lambda: not visible_on(b, owner, machine.session_id), timeout=20, what="B dropping it")
        assert chat(b, owner.api_key, SELF).json()["error"]["code"] == "machine_offline"

        nats_proxy.resume()
        wait_until(lambda: readyz(cut_off).get("nats") == "connected", timeout=30, what="reconnected")
        wait_until(lambda: visible_on(b, owner, machine.session_id), timeout=20, what="its machine on B again")
        wait_until(lambda: readyz(cut_off).get("fabric") == "in_sync" and readyz(b).get("fabric") == "in_sync",
                   timeout=20, what="both in step again")
        remote = chat(b, owner.api_key, SELF)
        assert remote.status_code == 200 and remote.headers["x-provider-id"] == machine.session_id
    finally:
        machine.close()
        nats_proxy.close()
