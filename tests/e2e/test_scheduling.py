"""The scheduler end to end, with real coordinator and provider processes: the per-model queue,
failover when a provider dies before first content, the speculative backup with `cancel` to the
stalled provider, the trust floor, and the queue's 429s.

Providers run the `openai` backend in front of bench/fixed_upstream.py (instant, deterministic
answers); the test backend `FirstTokenDelayBackend` (tests/support/backends.py, via `node_cmd`) makes
a provider slow to its first token so a test knows it is "before first content". Each test gets
its own coordinator, because the knobs under test are coordinator flags.
"""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.accounts import Account, create_account
from tests.support.processes import (Coordinator, Process, node_cmd, spawn, start_coordinator,
                                     start_fixed_upstream, wait_until)

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16}
FIXED_ANSWER = "The quick brown fox jumps over the lazy dog."  # what bench/fixed_upstream.py says


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url = start_fixed_upstream(tmp_path_factory.mktemp("upstream"))
    try:
        yield url
    finally:
        process.stop()


class Cluster:
    """One coordinator and the provider nodes a test starts on it; everything stopped at the end."""

    def __init__(self, root: Path, upstream: str, *coordinator_args: str) -> None:
        self.root = root
        self.upstream = upstream
        self.nodes: list[Process] = []
        self.coordinator: Coordinator = start_coordinator(
            root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}", *coordinator_args)
        self.account: Account = create_account(self.coordinator, credit_micro_usd=50_000_000)

    def node(self, name: str, *, first_token_delay: float = 0.0, max_concurrency: int = 1) -> tuple[Process, str]:
        """A provider node (unowned: the public fleet) and its session id once registered."""
        process = spawn(node_cmd("serve", "--coordinator", self.coordinator.base_url, "--backend", "openai",
                                 "--upstream-url", self.upstream, "--model", MODEL,
                                 "--max-concurrency", str(max_concurrency), first_token_delay=first_token_delay),
                        self.root / name, "node.log")
        self.nodes.append(process)

        def registered() -> str | None:
            if process.proc.poll() is not None:
                raise AssertionError(f"node {name} exited:\n{process.log()}")
            match = re.search(r"registered as (prov_\w+)", process.log())
            return match.group(1) if match else None

        return process, str(wait_until(registered, timeout=60, interval=0.05, what=f"node {name} registered"))

    def chat(self, timeout: float = 90, **fields: object) -> httpx.Response:
        return httpx.post(self.coordinator.api_url + "/chat/completions", json={**BODY, **fields},
                          headers=self.account.headers(), timeout=timeout)

    def close(self) -> None:
        for process in self.nodes:
            process.stop()
        self.coordinator.stop()


@pytest.fixture
def cluster(tmp_path: Path, upstream: str) -> Iterator[object]:
    made: list[Cluster] = []

    def make(*coordinator_args: str) -> Cluster:
        made.append(Cluster(tmp_path / f"cluster{len(made)}", upstream, *coordinator_args))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()


def accepted(node: Process) -> list[str]:
    """Request ids the node accepted, in order."""
    return re.findall(r"request (chatcmpl-\w+) accepted", node.log())


def completed(node: Process) -> list[str]:
    return re.findall(r"request (chatcmpl-\w+) complete:", node.log())


def log_position(node: Process, text: str) -> int:
    position = node.log().find(text)
    assert position >= 0, f"{text!r} not in the node log:\n{node.log()}"
    return position


def answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_a_request_waits_for_the_busy_provider_and_completes(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster()
    node, provider_id = c.node("busy", first_token_delay=3, max_concurrency=1)
    with ThreadPoolExecutor(2) as pool:
        first: Future[httpx.Response] = pool.submit(c.chat)
        wait_until(lambda: accepted(node), timeout=30, what="the first request on the node")
        second: Future[httpx.Response] = pool.submit(c.chat)  # the node's one slot is taken: it queues
        responses = [first.result(), second.result()]
    assert [answer(r) for r in responses] == [FIXED_ANSWER, FIXED_ANSWER]
    assert [r.headers["x-provider-id"] for r in responses] == [provider_id, provider_id]
    first_id, second_id = (r.headers["x-request-id"] for r in responses)
    # dispatched only once the slot freed (the node would refuse a second concurrent request)
    assert log_position(node, f"request {first_id} complete") < log_position(node, f"request {second_id} accepted")
    assert "busy (max_concurrency" not in node.log()


def _one_request_each(c: Cluster, victim: Process, other: Process) -> tuple[Future[httpx.Response],
                                                                          Future[httpx.Response], str]:
    """Two concurrent requests on two one-slot nodes: one lands on each. Returns both futures and
    the id of the request the victim accepted, once the other node has finished its own."""
    pool = ThreadPoolExecutor(2)
    futures = (pool.submit(c.chat), pool.submit(c.chat))
    pool.shutdown(wait=False)
    victim_request = wait_until(lambda: accepted(victim) and accepted(victim)[0], timeout=30,
                                what="a request on the victim")
    wait_until(lambda: completed(other), timeout=30, what="the other node's own request to finish")
    return futures[0], futures[1], victim_request


def test_a_provider_killed_before_first_content_fails_over(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster("--first-content-timeout", "120")  # no backup: only the kill moves the request
    victim, victim_id = c.node("victim", first_token_delay=60)
    other, other_id = c.node("other", first_token_delay=0.5)
    first, second, moved = _one_request_each(c, victim, other)
    victim.kill()  # SIGKILL while the victim is surely before first content
    responses = {r.headers["x-request-id"]: r for r in (first.result(), second.result())}
    assert answer(responses[moved]) == FIXED_ANSWER
    assert responses[moved].headers["x-provider-id"] == other_id != victim_id
    assert moved in accepted(other)


def test_a_stalled_provider_gets_a_backup_and_a_cancel(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster("--first-content-timeout", "8")  # backup after 4 s of silence
    stalled, stalled_id = c.node("stalled", first_token_delay=30)
    other, other_id = c.node("other", first_token_delay=0.5)
    first, second, raced = _one_request_each(c, stalled, other)
    responses = {r.headers["x-request-id"]: r for r in (first.result(), second.result())}
    assert answer(responses[raced]) == FIXED_ANSWER
    assert responses[raced].headers["x-provider-id"] == other_id != stalled_id
    assert raced in accepted(other)
    wait_until(lambda: f"request {raced} cancelled by the coordinator" in stalled.log(), timeout=10,
               what="the stalled node to log the cancel")
    assert stalled.proc.poll() is None  # it was cancelled, not killed


def test_min_trust_hardware_keeps_public_requests_off_self_signed_nodes(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster("--min-trust", "hardware")
    node, _ = c.node("self-signed")
    assert "trust self_signed" in node.log()
    response = c.chat(timeout=30)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "model_unavailable"
    assert accepted(node) == []
    listed = httpx.get(c.coordinator.api_url + "/models", headers=c.account.headers()).json()["data"]
    assert MODEL not in [m["id"] for m in listed]


def test_queue_full_and_queue_timeout(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster("--queue-depth", "1", "--queue-max-wait", "1.5")
    node, _ = c.node("slow", first_token_delay=5, max_concurrency=1)
    with ThreadPoolExecutor(3) as pool:
        busy = pool.submit(c.chat)
        wait_until(lambda: accepted(node), timeout=30, what="the first request on the node")
        waiting = [pool.submit(c.chat), pool.submit(c.chat)]  # one fits the queue, one does not
        refused = [f.result() for f in waiting]
        assert answer(busy.result()) == FIXED_ANSWER
    codes = []
    for response in refused:
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert error["type"] == "rate_limit_exceeded"
        assert int(response.headers["retry-after"]) >= 1
        codes.append(error["code"])
    assert sorted(codes) == ["queue_full", "queue_timeout"]
    assert len(accepted(node)) == 1  # neither refused request reached the provider
