"""What a node reports is held to what the coordinator can check (issue 19 row 16): an upstream
(openai backend) that counts 2^63 prompt tokens is clamped to the prompt bound the coordinator
computes from the same body (`wire.token_bounds`), so the honest node is never distrusted for it;
the cached tokens a backend reports are held within 0 and the prompt tokens reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from darkbloom.provider.backends.base import chunk_usage, usage_chunk
from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend
from darkbloom.provider.fleet_requests import Job
from darkbloom.provider.outbox import closed_outbox
from darkbloom.wire import protocol
from darkbloom.wire.token_bounds import prompt_token_bound
from tests.provider.test_node_cancel import MODEL, STORY, Stall, cancel, running_node, sealed, settle
from tests.support.backends import BackendCall, MockBackend
from tests.support.scripted_upstream import Scripted

HUGE = 2**63
BODY = {"model": MODEL, "max_tokens": 8, "stream": True,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]}


def liar(prompt_tokens: int, completion_tokens: int = 2) -> Any:
    """An upstream that streams two words, then usage with `prompt_tokens`."""
    def handler(request: httpx.Request) -> httpx.Response:
        events = [{"id": "u", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                  for word in ("Hel", "lo")]
        events.append({"id": "u", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
    return handler


async def completion(conn: Any) -> protocol.InferenceComplete:
    while not isinstance(frame := await conn.recv(), protocol.InferenceComplete):
        assert isinstance(frame, (protocol.Heartbeat, protocol.InferenceAccepted, protocol.InferenceResponseChunk)), \
            frame
    return frame


@pytest.mark.parametrize("prompt_tokens", [HUGE, 10**6])
async def test_an_upstreams_impossible_prompt_count_is_clamped_to_the_bound(home: Path, scripted: Scripted,
                                                                            prompt_tokens: int) -> None:
    url = await scripted(liar(prompt_tokens))
    backend = OpenAIUpstreamBackend(url, [MODEL])
    async with running_node(home, backend, upstream_url=url) as (conn, _node):
        await conn.send(sealed(conn, "req_1", BODY)[1])
        done = await completion(conn)
        assert done.usage.prompt_tokens == prompt_token_bound("chat", BODY) < prompt_tokens
        assert done.usage.completion_tokens == 2


async def test_an_honest_count_is_reported_as_it_is(home: Path, scripted: Scripted) -> None:
    url = await scripted(liar(17))
    async with running_node(home, OpenAIUpstreamBackend(url, [MODEL]), upstream_url=url) as (conn, _node):
        await conn.send(sealed(conn, "req_1", BODY)[1])
        done = await completion(conn)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (17, 2)


@pytest.mark.parametrize("api, body", [
    ("chat", BODY),
    ("completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}),
    ("embeddings", {"model": MODEL, "input": ["a", "bb"]}),
])
def test_every_report_is_held_to_the_bound_cancelled_ones_too(api: protocol.Api, body: dict[str, Any]) -> None:
    """`Job.report` makes the usage of a completed request and of a cancelled one alike."""
    job = Job("req_1", closed_outbox(), api=api, body=body)
    assert job.report(HUGE, 0).prompt_tokens == prompt_token_bound(api, body)
    assert job.report(3, 0).prompt_tokens == 3
    assert Job("req_2", closed_outbox(), body={"model": MODEL}, api="embeddings").report(HUGE, 0).prompt_tokens \
        == HUGE  # a body with no bound to compute (refused by the backend anyway): nothing to clamp to


@pytest.mark.parametrize("details, cached", [
    ({"cached_tokens": 32}, 32),
    ({"cached_tokens": 0}, 0),
    (None, 0),                       # a backend that does not know (the openai backend)
    ({"cached_tokens": 99}, 40),     # never more than the prompt
    ({"cached_tokens": -3}, 0),
    ({"cached_tokens": "32"}, 0),
    ({"cached_tokens": True}, 0),
    ("32", 0),
])
def test_a_backends_usage_chunk_gives_its_cached_tokens_within_the_prompt(details: Any, cached: int) -> None:
    chunk = usage_chunk("x", "m", 1, 40, 5)
    if details is not None:
        chunk["usage"]["prompt_tokens_details"] = details
    assert chunk_usage(chunk) == protocol.Usage(prompt_tokens=40, completion_tokens=5, cached_tokens=cached)
    assert chunk_usage(usage_chunk("x", "m", 1, 40, 5, cached_tokens=12)).cached_tokens == 12


def test_the_cached_tokens_reported_are_some_of_the_prompt_tokens_reported() -> None:
    job = Job("req_1", closed_outbox(), api="chat", body=BODY)
    bound = prompt_token_bound("chat", BODY)
    assert job.report(10, 1, 7).cached_tokens == 7
    assert job.report(10, 1).cached_tokens == 0  # a backend that does not know
    assert job.report(10, 1, -2).cached_tokens == 0
    clamped = job.report(HUGE, 1, HUGE)  # the prompt held to its bound: the cached tokens with it
    assert (clamped.prompt_tokens, clamped.cached_tokens) == (bound, bound)


async def test_a_backends_cached_tokens_reach_the_coordinator(home: Path) -> None:
    backend = caching_backend(cached_tokens=5)
    async with running_node(home, backend) as (conn, _node):
        await conn.send(sealed(conn, "req_1", BODY)[1])
        done = await completion(conn)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.cached_tokens) == (9, 1, 5)


def caching_backend(cached_tokens: int) -> MockBackend:
    """A chat backend (a stand-in, not a model) whose usage chunk says it read `cached_tokens` of its
    9 prompt tokens from a cache."""
    return MockBackend(lambda call: [
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": call.model_id,
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]},
        usage_chunk("c", call.model_id, 1, 9, 1, cached_tokens=cached_tokens)])


async def test_a_cancelled_requests_report_says_its_cached_tokens(home: Path) -> None:
    stall = Stall(prompt_tokens=42, chunks=1)

    def cached_stall(call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        call.meter.cached_tokens = 30  # as a backend that found 30 of the prompt's tokens in its cache
        return stall(call)

    async with running_node(home, MockBackend(cached_stall)) as (conn, node):
        await conn.send(sealed(conn, "req_1", STORY)[1])
        await conn.recv_type(protocol.InferenceAccepted)
        await stall.waiting.wait()
        report = await settle(conn, await cancel(conn, node, "req_1"))
        assert (report.usage.prompt_tokens, report.usage.completion_tokens, report.usage.cached_tokens) == (42, 1, 30)

