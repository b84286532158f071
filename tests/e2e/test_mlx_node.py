"""A node with `--backend mlx` end to end: a real coordinator (a catalog pricing the model), a real node
serving the bundled SmolLM2 converted to an MLX directory, the official `openai` SDK and Anthropic's
Messages API over HTTP. The node registers (backend mlx, device cpu), answers every API through the
coordinator for its owner (Self-Route, free) and for a paying account (usage rows exact, the catalog's
cost taken from the balance), reuses a conversation's prefix, never receives what it cannot serve
(tools, structured output, embeddings: refused by the coordinator's capability gate, nothing charged),
settles a stream the client closed for the tokens it made, and serves direct mode. One stack for the
module; answers are greedy and short."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.accounts import (Account, balance, create_account, login_node, start_node, wait_model_listed,
                                    wait_online)
from tests.support.billing import wait_settled, write_catalog
from tests.support.mlx_model import converted_smollm2
from tests.support.processes import Coordinator, Process, start_coordinator, wait_until

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-mlx"
INPUT_PRICE, OUTPUT_PRICE = 13_333_333, 46_666_667  # µUSD per 1M tokens: fractional per token, so ceil shows
MIN_CHARGE = 100
SELF = {"X-Darkbloom-Route": "self"}
DEVICE = "metal" if (platform.system(), platform.machine()) == ("Darwin", "arm64") else "cpu"  # MLX's CPU build here
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def cost_of(prompt: int, completion: int) -> int:
    raw = math.ceil(Fraction(prompt * INPUT_PRICE, 10**6)) + math.ceil(Fraction(completion * OUTPUT_PRICE, 10**6))
    return max(MIN_CHARGE, raw)


@dataclass
class Stack:
    coordinator: Coordinator
    database_url: str
    owner: Account     # the node's account: its requests are Self-Routed, free
    consumer: Account  # no machine, a balance: its requests go to the fleet (this node) and are paid
    node: Process
    node_home: Path
    tokenizer: Any     # the model directory's own tokenizer (Hugging Face), to count prompts apart from the node

    def sdk(self, account: Account, **headers: str) -> OpenAI:
        return OpenAI(base_url=self.coordinator.api_url, api_key=account.api_key, max_retries=0, timeout=120,
                      default_headers=headers or None)

    def usage_rows(self, account: Account) -> list[dict[str, Any]]:
        response = httpx.get(self.coordinator.api_url + "/payments/usage", headers=account.headers(), timeout=30)
        response.raise_for_status()
        return list(response.json()["data"])

    def usage_row(self, account: Account, request_id: str) -> dict[str, Any]:
        """The request's usage row, once it is settled."""
        wait_settled(self.database_url, request_ids=[request_id])
        return dict(wait_until(lambda: next((r for r in self.usage_rows(account) if r["request_id"] == request_id),
                                            None), timeout=30, interval=0.2, what=f"the usage row of {request_id}"))

    def chat_prompt_tokens(self, messages: list[dict[str, Any]]) -> int:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from transformers import AutoTokenizer

    model_dir = converted_smollm2()
    root = tmp_path_factory.mktemp("mlx-node")
    catalog = write_catalog(root / "catalog.json", {"id": MODEL, "input_price": INPUT_PRICE,
                                                    "output_price": OUTPUT_PRICE, "max_output_tokens": 256})
    database_url = f"sqlite+aiosqlite:///{root / 'coordinator.db'}"
    coordinator = start_coordinator(root / "coordinator", database_url, "--catalog", str(catalog))
    node = None
    try:
        owner = create_account(coordinator)  # no balance: only free Self-Routed requests can succeed
        consumer = create_account(coordinator, credit_micro_usd=10_000_000)
        node_home = root / "node"
        login_node(coordinator, node_home, owner)
        node = start_node(coordinator, node_home, "--backend", "mlx", "--model", f"{MODEL}={model_dir}",
                          "--max-concurrency", "2", "--local-endpoint", "--port", "0")
        wait_online(coordinator, owner)
        wait_model_listed(coordinator, consumer, MODEL)
        yield Stack(coordinator, database_url, owner, consumer, node, node_home,
                    AutoTokenizer.from_pretrained(str(model_dir)))
    finally:
        if node is not None:
            node.stop()
        coordinator.stop()


# registration


def test_the_node_registers_as_an_mlx_machine_on_the_cpu(stack: Stack) -> None:
    listing = httpx.get(stack.coordinator.api_url + "/me/providers", headers=stack.owner.headers(), timeout=30)
    [machine] = listing.json()["data"]
    assert machine["online"] and machine["backend"] == "mlx" and machine["device"] == DEVICE
    assert machine["models"] == [MODEL]
    assert ("MLX backend ready on the CPU" in stack.node.log()) == (DEVICE == "cpu")
    own = httpx.get(stack.coordinator.api_url + "/me/self-route-models", headers=stack.owner.headers(), timeout=30)
    assert own.json() == {"models": [MODEL]}


# every API, Self-Routed and paid

Answer = tuple[str, int, int, str]  # (request id, prompt tokens, completion tokens, text)


def chat(sdk: OpenAI) -> Answer:
    raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=FRANCE,  # type: ignore[arg-type]
                                                        max_tokens=12, temperature=0)
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "stop" and reply.usage is not None
    return (raw.headers["x-request-id"], reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.choices[0].message.content or "")


def chat_streamed(sdk: OpenAI) -> Answer:
    stream = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,  # type: ignore[arg-type]
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, piece by piece
    return stream.response.headers["x-request-id"], usage.prompt_tokens, usage.completion_tokens, text


def responses(sdk: OpenAI) -> Answer:
    raw = sdk.responses.with_raw_response.create(model=MODEL, input=FRANCE,  # type: ignore[arg-type]
                                                 max_output_tokens=12, temperature=0)
    response = raw.parse()
    assert response.status == "completed" and response.usage is not None
    return raw.headers["x-request-id"], response.usage.input_tokens, response.usage.output_tokens, response.output_text


def responses_streamed(sdk: OpenAI) -> Answer:
    stream = sdk.responses.create(model=MODEL, input=FRANCE, max_output_tokens=12,  # type: ignore[arg-type]
                                  temperature=0, stream=True)
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    [done] = [e for e in events if e.type == "response.completed"]
    usage = done.response.usage
    assert len(deltas) > 1 and usage is not None and "".join(deltas) == done.response.output_text
    return stream.response.headers["x-request-id"], usage.input_tokens, usage.output_tokens, "".join(deltas)


def completions(sdk: OpenAI) -> Answer:
    raw = sdk.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                                   temperature=0)
    done = raw.parse()
    assert done.usage is not None
    return raw.headers["x-request-id"], done.usage.prompt_tokens, done.usage.completion_tokens, done.choices[0].text


def messages(sdk: OpenAI) -> Answer:
    headers = {"x-api-key": sdk.api_key, "anthropic-version": "2023-06-01", **sdk.default_headers}  # type: ignore
    headers.pop("Authorization", None)
    response = httpx.post(str(sdk.base_url) + "messages", headers={k: str(v) for k, v in headers.items()},
                          json={"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": FRANCE}, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()
    usage = message["usage"]
    assert message["stop_reason"] == "end_turn"
    return (response.headers["x-request-id"], usage["input_tokens"] + usage["cache_read_input_tokens"],
            usage["output_tokens"], "".join(block.get("text", "") for block in message["content"]))


def messages_streamed(sdk: OpenAI) -> Answer:
    headers = {"x-api-key": sdk.api_key, "anthropic-version": "2023-06-01", **sdk.default_headers}  # type: ignore
    headers.pop("Authorization", None)
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": FRANCE, "stream": True}
    with httpx.stream("POST", str(sdk.base_url) + "messages", headers={k: str(v) for k, v in headers.items()},
                      json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        request_id = response.headers["x-request-id"]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    [start] = [e for e in events if e["type"] == "message_start"]
    [delta] = [e for e in events if e["type"] == "message_delta"]
    usage = delta["usage"]
    assert delta["delta"]["stop_reason"] == "end_turn"
    prompt = usage.get("input_tokens", start["message"]["usage"]["input_tokens"])
    return request_id, prompt + usage.get("cache_read_input_tokens", 0), usage["output_tokens"], text


APIS: dict[str, Callable[[OpenAI], Answer]] = {
    "chat": chat, "chat-stream": chat_streamed, "responses": responses, "responses-stream": responses_streamed,
    "completions": completions, "messages": messages, "messages-stream": messages_streamed}


def expected_prompt(stack: Stack, api: str) -> int:
    if api == "completions":
        return len(stack.tokenizer.encode("The capital of France is", add_special_tokens=False))
    return stack.chat_prompt_tokens(FRANCE)


@pytest.mark.parametrize("api", APIS)
def test_self_route_answers_free(stack: Stack, api: str) -> None:
    request_id, prompt, completion, text = APIS[api](stack.sdk(stack.owner, **SELF))
    assert text.startswith(" Paris" if api == "completions" else "The capital of France is Paris")
    assert prompt == expected_prompt(stack, api) and completion > 0
    row = stack.usage_row(stack.owner, request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
    assert row["cost_micro_usd"] == 0 and row["self_routed"] and row["routed"] == "owned" and row["model"] == MODEL
    assert balance(stack.coordinator, stack.owner) == 0


@pytest.mark.parametrize("api", APIS)
def test_a_paid_request_costs_what_the_catalog_says(stack: Stack, api: str) -> None:
    before = balance(stack.coordinator, stack.consumer)
    request_id, prompt, completion, text = APIS[api](stack.sdk(stack.consumer))
    assert text.startswith(" Paris" if api == "completions" else "The capital of France is Paris")
    assert prompt == expected_prompt(stack, api) and completion > 0
    row = stack.usage_row(stack.consumer, request_id)
    cost = cost_of(prompt, completion)
    assert cost > MIN_CHARGE  # the catalog's prices, not the minimum
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_micro_usd"]) == (prompt, completion, cost)
    assert not row["self_routed"] and row["routed"] == "fleet" and row["model"] == MODEL
    assert balance(stack.coordinator, stack.consumer) == before - cost


def test_routing_headers_say_owned_and_free_or_fleet_and_charged(stack: Stack) -> None:
    own = stack.sdk(stack.owner, **SELF).chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    paid = stack.sdk(stack.consumer).chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert (own.headers["x-darkbloom-routed"], own.headers["x-darkbloom-billing"]) == ("owned", "free")
    assert (paid.headers["x-darkbloom-routed"], paid.headers["x-darkbloom-billing"]) == ("fleet", "charged")
    assert own.headers["x-provider-id"] == paid.headers["x-provider-id"]


def test_logprobs_and_a_list_of_prompts_are_served(stack: Stack) -> None:
    sdk = stack.sdk(stack.consumer)
    reply = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=5, temperature=0,  # type: ignore
                                        logprobs=True, top_logprobs=2)
    assert reply.usage is not None and reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content or []
    assert len(content) == reply.usage.completion_tokens == 5 and all(len(t.top_logprobs) == 2 for t in content)
    batch = sdk.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"], max_tokens=3,
                                   temperature=0, logprobs=1)
    assert sorted(c.index for c in batch.choices) == [0, 1] and batch.usage is not None
    assert batch.usage.completion_tokens == 6


# prefix reuse through the coordinator


def test_a_second_chat_turn_reports_its_cached_tokens(stack: Stack) -> None:
    sdk = stack.sdk(stack.owner, **SELF)
    first = [{"role": "user", "content": "Name one thing about owls."}]
    reply = sdk.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)  # type: ignore
    assert reply.usage is not None
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content or ""},
              {"role": "user", "content": "Tell me one more."}]
    again = sdk.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)  # type: ignore
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert reply.usage.prompt_tokens - 1 <= cached < again.usage.prompt_tokens
    stream = sdk.chat.completions.create(model=MODEL, messages=second, max_tokens=8,  # type: ignore[arg-type]
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the same prompt again


def test_a_second_responses_turn_reports_its_cached_input(stack: Stack) -> None:
    sdk = stack.sdk(stack.consumer)
    first: list[Any] = [{"role": "user", "content": "Name one thing about bees."}]
    response = sdk.responses.create(model=MODEL, input=first, max_output_tokens=12, temperature=0)
    assert response.usage is not None
    second: Any = [*first, {"role": "assistant", "content": response.output_text},
                   {"role": "user", "content": "Tell me one more."}]
    again = sdk.responses.create(model=MODEL, input=second, max_output_tokens=8, temperature=0)
    assert again.usage is not None
    assert response.usage.input_tokens - 1 <= again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


def test_a_second_anthropic_turn_reports_its_cache_read(stack: Stack) -> None:
    url = stack.coordinator.api_url + "/messages"
    headers = {"x-api-key": stack.owner.api_key, "anthropic-version": "2023-06-01", **SELF}
    first = [{"role": "user", "content": "Name one thing about cats."}]
    message = httpx.post(url, json={"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": first},
                         headers=headers, timeout=120).json()
    text = "".join(block.get("text", "") for block in message["content"])
    second = [*first, {"role": "assistant", "content": text or "Cats purr."},
              {"role": "user", "content": "Tell me one more."}]
    again = httpx.post(url, json={"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": second},
                       headers=headers, timeout=120).json()
    usage = again["usage"]
    first_prompt = message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= first_prompt - 1 and usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] > 0  # the new turn's tokens, the others read from the cache


# what the node does not serve never reaches it

UNSERVED = [  # (path, body fields, the parameter a refusal names)
    ("/chat/completions", {"messages": FRANCE, "tools": [WEATHER], "tool_choice": "auto"}, "tools"),
    ("/chat/completions", {"messages": FRANCE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}}, "response_format"),
    ("/embeddings", {"input": "hello"}, "model"),
]


@pytest.mark.parametrize("path, fields, param", UNSERVED, ids=["tools", "json_schema", "embeddings"])
def test_what_mlx_does_not_serve_is_refused_by_the_coordinator_and_free(stack: Stack, path: str,
                                                                        fields: dict[str, Any], param: str) -> None:
    served = len(stack.node.log().splitlines())
    rows = {account.account_id: len(stack.usage_rows(account)) for account in (stack.owner, stack.consumer)}
    before = balance(stack.coordinator, stack.consumer)
    url = stack.coordinator.api_url + path
    body = {"model": MODEL, "max_tokens": 8, **fields}

    own = httpx.post(url, json=body, headers={**stack.owner.headers(), **SELF}, timeout=60)
    assert own.status_code == 503, own.text
    error = own.json()["error"]
    assert (error["type"], error["code"]) == ("model_unavailable", "model_capability_unsupported")
    assert "Your machine serves" in error["message"]

    paid = httpx.post(url, json=body, headers=stack.consumer.headers(), timeout=60)
    assert paid.status_code == 400, paid.text
    error = paid.json()["error"]
    assert (error["code"], error["param"]) == ("model_capability_unsupported", param)

    assert balance(stack.coordinator, stack.consumer) == before
    assert {a.account_id: len(stack.usage_rows(a)) for a in (stack.owner, stack.consumer)} == rows
    assert " accepted for " not in "\n".join(stack.node.log().splitlines()[served:])  # nothing reached the node


def test_tools_offered_but_not_to_be_called_are_answered(stack: Stack) -> None:
    reply = stack.sdk(stack.owner, **SELF).chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=12, temperature=0, tools=[WEATHER],  # type: ignore[arg-type,list-item]
        tool_choice="none")
    assert (reply.choices[0].message.content or "").startswith("The capital of France is Paris")


# cancel


def test_a_stream_closed_by_the_client_is_settled_for_its_tokens(stack: Stack) -> None:
    before = balance(stack.coordinator, stack.consumer)
    stream = stack.sdk(stack.consumer).chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=200, temperature=0, stream=True)  # type: ignore[arg-type]
    request_id = stream.response.headers["x-request-id"]
    pieces = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if pieces == 4:
                break
    stream.close()
    row = stack.usage_row(stack.consumer, request_id)
    assert row["prompt_tokens"] == stack.chat_prompt_tokens(STORY)
    assert pieces <= row["completion_tokens"] < 200  # this prompt runs to the limit when not stopped
    assert row["cost_micro_usd"] == cost_of(row["prompt_tokens"], row["completion_tokens"])
    assert balance(stack.coordinator, stack.consumer) == before - row["cost_micro_usd"]
    # the node serves on
    request_id, prompt, completion, text = chat(stack.sdk(stack.consumer))
    assert text.startswith("The capital of France is Paris") and completion > 0


# direct mode


def local(stack: Stack) -> OpenAI:
    found = wait_until(lambda: (path := stack.node_home / "local.json").exists() and json.loads(path.read_text()),
                       timeout=60, what="local.json")
    return OpenAI(base_url=found["base_url"], api_key=found["api_key"], max_retries=0, timeout=120)


def test_direct_mode_answers_chat_and_completions_and_streams(stack: Stack) -> None:
    sdk = local(stack)
    assert [m.id for m in sdk.models.list()] == [MODEL]
    reply = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12, temperature=0)  # type: ignore
    assert (reply.choices[0].message.content or "").startswith("The capital of France is Paris")
    assert reply.usage is not None and reply.usage.prompt_tokens == stack.chat_prompt_tokens(FRANCE)
    stream = sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,  # type: ignore[arg-type]
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    done = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert done.choices[0].text.startswith(" Paris") and done.choices[0].finish_reason == "length"
    streamed = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


@pytest.mark.parametrize("path, fields, param", UNSERVED, ids=["tools", "json_schema", "embeddings"])
def test_direct_mode_refuses_what_mlx_does_not_serve_naming_the_param(stack: Stack, path: str,
                                                                      fields: dict[str, Any], param: str) -> None:
    sdk = local(stack)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.post(path, body={"model": MODEL, "max_tokens": 8, **fields}, cast_to=object)
    assert refused.value.status_code == 400 and refused.value.param == param
