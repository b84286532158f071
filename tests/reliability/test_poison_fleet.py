"""Issue 19, row 1, as it was found: a coordinator and three real llama.cpp nodes, and the poison
schemas that once killed all three (one uncharged request walked across the fleet by its retries).

Through the coordinator each is a 400 naming its bound, nothing is reserved or charged, and the three
node processes are all alive afterwards and serve. (What a node does when a poison schema reaches it
anyway — its own bound, before any grammar is built — is tests/reliability/test_hostile_requests_node.py.)
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from tests.support.accounts import Account, balance, create_account, login_node, start_node, wait_online
from tests.support.hostile import usage_ids
from tests.support.processes import Coordinator, Process, sqlite_coordinator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Say hello."}]


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}


POISON: list[tuple[str, dict[str, Any], str]] = [
    ("/chat/completions", {"messages": ASK, "response_format": _schema_format({"type": "string", "maxLength": 20_000})},
     "response_format.json_schema.schema.maxLength"),
    ("/chat/completions", {"messages": ASK, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 30_000}}}}}]},
     "tools[0].function.parameters.properties.q.maxLength"),
    ("/chat/completions", {"messages": ASK, "response_format": _schema_format(
        {"type": "array", "items": {"type": "integer"}, "maxItems": 50_000})},
     "response_format.json_schema.schema.maxItems"),
    ("/responses", {"input": "Say hello.", "text": {"format": {"type": "json_schema", "name": "b", "schema": {
        "type": "string", "maxLength": 20_000}}}}, "text.format.schema.maxLength"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, Account, list[Process]]]:
    """Three nodes of one owner, one request at a time each."""
    root = tmp_path_factory.mktemp("poison-fleet")
    with sqlite_coordinator(root) as coord:
        owner = create_account(coord)
        nodes: list[Process] = []
        try:
            for index in range(3):
                home = root / f"node-{index}"
                login_node(coord, home, owner)
                nodes.append(start_node(coord, home, "--max-concurrency", "1"))
            wait_online(coord, owner, count=3)
            yield coord, owner, nodes
        finally:
            for node in nodes:
                node.stop()


@pytest.fixture(scope="module")
def consumer(fleet: tuple[Coordinator, Account, list[Process]]) -> Account:
    return create_account(fleet[0], credit_micro_usd=10_000_000)


@pytest.mark.parametrize(("path", "body", "param"), POISON, ids=["response_format", "tool", "max_items", "responses"])
def test_a_poison_schema_is_refused_and_all_three_nodes_live_on(
        fleet: tuple[Coordinator, Account, list[Process]], consumer: Account, path: str, body: dict[str, Any],
        param: str) -> None:
    coord, owner, nodes = fleet
    before = balance(coord, consumer), usage_ids(coord, consumer)
    answer = httpx.post(coord.api_url + path, json={"model": MODEL, **body},
                        headers=consumer.headers(), timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert (balance(coord, consumer), usage_ids(coord, consumer)) == before
    for node in nodes:
        assert node.proc.poll() is None, node.log()
        assert "Segmentation" not in node.log()
    served = httpx.post(coord.api_url + "/chat/completions", headers=consumer.headers(), timeout=120,
                        json={"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 0})
    assert served.status_code == 200, served.text
    assert len(wait_online(coord, owner, count=3)) == 3
