"""What a node reports is held to what the coordinator can check (issue 19 row 16): an upstream
(openai backend) that counts 2^63 prompt tokens is clamped to the prompt bound the coordinator
computes from the same body (`wire.token_bounds`), so the honest node is never distrusted for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend
from darkbloom.provider.fleet_requests import Job
from darkbloom.provider.outbox import closed_outbox
from darkbloom.wire import protocol
from darkbloom.wire.token_bounds import prompt_token_bound
from tests.provider.test_node_cancel import MODEL, running_node, sealed
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
