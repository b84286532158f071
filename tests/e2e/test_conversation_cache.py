"""A conversation through a real coordinator and real nodes on the bundled model: its second turn reads
the first from the node's cache and every API says so (docs/api.md "Cached prompt tokens"); with two
nodes, each conversation's second turn goes back to the machine that served its first (docs/routing.md
"Conversations stay on their machine")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack
from tests.support.accounts import Account, create_account, login_node, start_node, wait_model_listed, wait_online
from tests.support.processes import Coordinator, Process, start_coordinator

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. You answer in one short sentence."}


def client(coordinator: Coordinator, account: Account) -> OpenAI:
    return OpenAI(base_url=coordinator.api_url, api_key=account.api_key, max_retries=0)


def first_turn(topic: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": f"Name one thing about {topic}."}]


def second_turn(first: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me one more."}]


def test_a_second_chat_turn_reads_the_first_from_the_cache(stack: Stack) -> None:
    sdk = client(stack.coordinator, stack.owner)
    first = first_turn("owls")
    answer = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=first, max_tokens=12,
                                                           temperature=0)
    reply = answer.parse()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert 0 <= reply.usage.prompt_tokens_details.cached_tokens < reply.usage.prompt_tokens
    second = second_turn(first, reply.choices[0].message.content or "")
    again = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=second, max_tokens=12, temperature=0)
    usage = again.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert again.headers["x-provider-id"] == answer.headers["x-provider-id"]

    third = second_turn(second, again.parse().choices[0].message.content or "")
    stream = sdk.chat.completions.create(model=MODEL, messages=third, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    streamed = [chunk for chunk in stream][-1].usage
    assert streamed is not None and streamed.prompt_tokens_details is not None
    assert streamed.prompt_tokens_details.cached_tokens >= usage.prompt_tokens // 2


def test_a_second_responses_turn_says_its_cached_input(stack: Stack) -> None:
    sdk = client(stack.coordinator, stack.owner)
    first: list[Any] = first_turn("bees")
    response = sdk.responses.create(model=MODEL, input=first, max_output_tokens=12, temperature=0)
    assert response.usage is not None
    second = second_turn(first, response.output_text)
    inputs: Any = second
    again = sdk.responses.create(model=MODEL, input=inputs, max_output_tokens=12, temperature=0)
    assert again.usage is not None and 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    with sdk.responses.stream(model=MODEL, input=inputs, max_output_tokens=12, temperature=0) as events:
        final = events.get_final_response()
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0


def test_a_second_anthropic_turn_says_its_cache_read(stack: Stack) -> None:
    url = stack.coordinator.api_url + "/messages"
    headers = {"x-api-key": stack.owner.api_key, "anthropic-version": "2023-06-01"}
    first = [{"role": "user", "content": "Name one thing about cats."}]
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "system": SYSTEM["content"]}
    message = httpx.post(url, json={**body, "messages": first}, headers=headers, timeout=60).json()
    text = "".join(block.get("text", "") for block in message["content"])
    second = [*first, {"role": "assistant", "content": text or "Cats purr."},
              {"role": "user", "content": "Tell me one more."}]
    again = httpx.post(url, json={**body, "messages": second}, headers=headers, timeout=60).json()
    usage = again["usage"]
    assert usage["cache_read_input_tokens"] > 0 and usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] > 0  # the new turn's tokens, the others read from the cache
    with httpx.stream("POST", url, json={**body, "messages": second, "stream": True}, headers=headers,
                      timeout=60) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ") and "message_delta" in line]
    assert lines and '"cache_read_input_tokens":0' not in lines[-1].replace(" ", "")


def test_a_legacy_completion_continued_reads_its_prompt_from_the_cache(stack: Stack) -> None:
    sdk = client(stack.coordinator, stack.owner)
    prompt = "The lighthouse keeper climbed the stairs every evening to light the lamp, and"
    done = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    longer = prompt + done.choices[0].text + " Then"
    again = sdk.completions.create(model=MODEL, prompt=longer, max_tokens=8, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_embeddings_say_nothing_of_a_cache(stack: Stack) -> None:
    raw = httpx.post(stack.coordinator.api_url + "/embeddings", json={"model": MODEL, "input": "hello"},
                     headers=stack.owner.headers(), timeout=60)
    assert raw.status_code == 200 and "prompt_tokens_details" not in raw.json()["usage"]


# two machines


class TwoNodes:
    def __init__(self, coordinator: Coordinator, account: Account, nodes: list[Process]) -> None:
        self.coordinator, self.account, self.nodes = coordinator, account, nodes

    def chat(self, messages: list[dict[str, Any]]) -> tuple[str, str, int]:
        """The answer's text, the session that served it and its cached tokens."""
        raw = client(self.coordinator, self.account).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return (reply.choices[0].message.content or "", raw.headers["x-provider-id"],
                reply.usage.prompt_tokens_details.cached_tokens)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    root: Path = tmp_path_factory.mktemp("two-nodes")
    coordinator = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}")
    nodes: list[Process] = []
    try:
        owner = create_account(coordinator, credit_micro_usd=10_000_000)
        for name in ("left", "right"):
            login_node(coordinator, root / name, owner)
            nodes.append(start_node(coordinator, root / name, "--max-concurrency", "1"))
        wait_online(coordinator, owner, count=2)
        wait_model_listed(coordinator, owner)
        yield TwoNodes(coordinator, create_account(coordinator, credit_micro_usd=10_000_000), nodes)
    finally:
        for node in nodes:
            node.stop()
        coordinator.stop()


def test_each_conversation_goes_back_to_its_machine(two_nodes: TwoNodes) -> None:
    """Two first turns at once take one machine each (one slot apiece); each second turn, sent one at a
    time when both machines are free — the scheduler would send both to the same one, the faster —
    finds its own machine and its cache."""
    topics = ("a lighthouse", "a dragon")
    firsts = [first_turn(topic) for topic in topics]
    with ThreadPoolExecutor(2) as pool:
        served = list(pool.map(two_nodes.chat, firsts))
    assert served[0][1] != served[1][1], "the two first turns should have run side by side"
    for first, (answer, machine, _) in zip(firsts, served):
        _, again, cached = two_nodes.chat(second_turn(first, answer))
        assert again == machine and cached > 0
