"""A cancelled request is settled: the node reports the tokens used so far in one inference_complete.
And inference_error messages (unsealed) never carry prompt or completion text.

The node runs against the fake coordinator with the openai backend (a real llama_cpp.server
upstream, or a scripted one) or with stand-in backends (`MockBackend`) for the timing corner cases;
the llama.cpp backend's cancel is in test_node.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.provider.backends import Backend
from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend, _estimate_prompt_tokens
from darkbloom.provider.config import load_config
from darkbloom.provider.fleet_requests import Job
from darkbloom.provider.node import ProviderNode
from tests.provider.fake_coordinator import Conn, FakeCoordinator
from tests.support.backends import BackendCall, MockBackend
from tests.support.scripted_upstream import Scripted

MODEL = "smollm2-135m"
SECRET = "the-secret-prompt-words"
STORY = {"model": MODEL, "max_tokens": 200,
         "messages": [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]}


@contextlib.asynccontextmanager
async def running_node(home: Path, backend: Backend, *, upstream_url: str = "http://upstream",
                       cancel_grace: float = 5.0) -> AsyncIterator[tuple[Conn, ProviderNode]]:
    """A registered node on the openai backend's config (no model file to hash), serving `backend`."""
    async with FakeCoordinator() as fake:
        config = load_config(home, {"coordinator_url": fake.url, "backend": "openai", "upstream_url": upstream_url,
                                    "models": [MODEL]})
        config.heartbeat_interval_secs = 0.2
        node = ProviderNode(config, home, backend)
        node.fleet.cancel_grace = cancel_grace
        stop = asyncio.Event()
        task = asyncio.create_task(node.run(stop))
        try:
            conn = await fake.accept()
            await conn.recv_type(protocol.Register)
            await conn.send(protocol.Registered(provider_id="prov_test", trust_level="self_signed"))
            yield conn, node
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


def sealed(conn: Conn, request_id: str, body: dict[str, Any]) -> tuple[crypto.ReplyKey, protocol.InferenceRequest]:
    reply_key = crypto.ReplyKey()
    envelope = reply_key.seal_request(json.dumps(body).encode(), crypto.public_key_from_b64(conn.frames[0].public_key))
    return reply_key, protocol.InferenceRequest(request_id=request_id, encrypted_body=envelope)


async def cancel(conn: Conn, node: ProviderNode, request_id: str) -> Job:
    """Send the coordinator's cancel for a running request; its job (taken before the node forgets it)."""
    job = node.fleet.jobs[request_id]
    await conn.send(protocol.Cancel(request_id=request_id))
    return job


async def settle(conn: Conn, job: Job) -> protocol.InferenceComplete:
    """The usage report for a cancelled request; content chunks sent before the cancel may precede it,
    an error may not. Nothing more for that request may follow: once its tasks (the only senders for
    it) have ended, a barrier shows everything they queued."""
    while True:
        frame = await conn.recv()
        if isinstance(frame, protocol.InferenceComplete):
            assert frame.request_id == job.request_id
            report = frame
            break
        assert isinstance(frame, (protocol.Heartbeat, protocol.InferenceResponseChunk)), frame
    report_at = len(conn.frames)
    await asyncio.wait_for(asyncio.gather(*(t for t in (job.task, job.settling) if t is not None),
                                          return_exceptions=True), 10)
    await conn.send(protocol.AttestationChallenge(nonce=crypto.b64e(os.urandom(32)), timestamp=int(time.time())))
    while not isinstance(await conn.recv(), protocol.AttestationResponse):
        pass
    assert [f for f in conn.frames[report_at:] if getattr(f, "request_id", None) == job.request_id] == []
    return report


async def idle_heartbeat(conn: Conn) -> None:
    while True:
        frame = await conn.recv()
        if isinstance(frame, protocol.Heartbeat) and frame.active_requests == 0:
            return


class Stall:
    """A backend's work still going on when the cancel comes (a `MockBackend` handler): it meters
    `prompt_tokens` (when given) and one token per chunk, yields `chunks` content chunks, sets
    `waiting`, then waits. With `ignores_stop` it stands for a worker that never stops: the meter's
    `end()` never comes."""

    def __init__(self, prompt_tokens: int | None = None, chunks: int = 0, ignores_stop: bool = False) -> None:
        self.prompt_tokens, self.chunks, self.ignores_stop = prompt_tokens, chunks, ignores_stop
        self.waiting = asyncio.Event()

    async def __call__(self, call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        if self.ignores_stop:
            call.meter.begin()
        if self.prompt_tokens is not None:
            call.meter.prompt_tokens = self.prompt_tokens
        for n in range(self.chunks):
            call.meter.completion_tokens = n + 1
            yield {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": call.model_id,
                   "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
        self.waiting.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("prompt_tokens, expected", [(None, (0, 0)), (42, (42, 0))])
async def test_cancel_before_any_output_reports_the_prompt_if_known(home: Path, prompt_tokens: int | None,
                                                                   expected: tuple[int, int]) -> None:
    stall = Stall(prompt_tokens)
    backend = MockBackend(stall)
    async with running_node(home, backend) as (conn, node):
        await conn.send(sealed(conn, "req_1", STORY)[1])
        await conn.recv_type(protocol.InferenceAccepted)
        await stall.waiting.wait()
        report = await settle(conn, await cancel(conn, node, "req_1"))
        assert (report.usage.prompt_tokens, report.usage.completion_tokens) == expected
        assert backend.calls[0].ended.is_set() and node.fleet.jobs == {}
        await idle_heartbeat(conn)


async def test_cancel_before_the_request_task_ever_ran(home: Path) -> None:
    backend = MockBackend(Stall(prompt_tokens=42))
    async with running_node(home, backend) as (conn, node):
        _, request = sealed(conn, "req_1", STORY)
        node._handle(request)  # both in one step: the request's task is cancelled before it starts
        job = node.fleet.jobs["req_1"]
        node._handle(protocol.Cancel(request_id="req_1"))
        report = await settle(conn, job)
        assert (report.usage.prompt_tokens, report.usage.completion_tokens) == (0, 0)
        assert not backend.calls and node.fleet.jobs == {}  # the slot is free again
        await idle_heartbeat(conn)


async def test_a_backend_that_does_not_stop_is_reported_after_the_grace(home: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    stall = Stall(prompt_tokens=42, chunks=3, ignores_stop=True)
    async with running_node(home, MockBackend(stall), cancel_grace=0.5) as (conn, node):
        reply_key, request = sealed(conn, "req_1", STORY)
        await conn.send(request)
        await conn.recv_type(protocol.InferenceAccepted)
        await conn.recv_chunks(reply_key, 2)
        await stall.waiting.wait()
        with caplog.at_level(logging.INFO, logger="darkbloom.provider"):
            await conn.send(protocol.Cancel(request_id="req_1"))
            while not isinstance(frame := await conn.recv(), protocol.InferenceComplete):
                assert isinstance(frame, (protocol.Heartbeat, protocol.InferenceResponseChunk)), frame
        assert (frame.request_id, frame.usage.prompt_tokens, frame.usage.completion_tokens) == ("req_1", 42, 3)
        assert "request req_1 cancelled by the coordinator" in caplog.text  # the line the e2e test waits for
        assert "did not stop within" in caplog.text  # reported once the grace ran out
        assert node.fleet.jobs == {}


async def test_cancel_on_the_openai_backend_with_a_real_upstream(home: Path, upstream: str) -> None:
    backend = OpenAIUpstreamBackend(upstream, [MODEL])
    async with running_node(home, backend, upstream_url=upstream) as (conn, node):
        reply_key, request = sealed(conn, "req_1", STORY)
        await conn.send(request)
        await conn.recv_type(protocol.InferenceAccepted)
        content = 0
        while content < 4:
            frame = await conn.recv_type(protocol.InferenceResponseChunk)
            content += sum(bool(chunk["choices"][0]["delta"].get("content"))
                           for chunk in response_chunks(reply_key.open(frame.encrypted_data)))
        report = await settle(conn, await cancel(conn, node, "req_1"))
        # llama_cpp.server streams no usage: the prompt estimate, one token per content chunk the
        # backend saw (a few may have been dropped after the cancel, never fewer than we received)
        assert report.usage.prompt_tokens == _estimate_prompt_tokens(STORY)
        assert 4 <= report.usage.completion_tokens < STORY["max_tokens"]
        # the upstream connection was closed and the backend serves the next request
        _, request = sealed(conn, "req_2", {**STORY, "max_tokens": 3})
        await conn.send(request)
        while not isinstance(done := await conn.recv(), protocol.InferenceComplete):
            assert getattr(done, "request_id", "req_2") == "req_2"
        assert done.request_id == "req_2" and done.usage.completion_tokens > 0


class _Stalling(httpx.AsyncByteStream):
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events, self.closed = events, asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()


@pytest.mark.parametrize("upstream_usage", [False, True])
async def test_cancel_on_the_openai_backend_with_a_scripted_upstream(home: Path, scripted: Scripted,
                                                                     upstream_usage: bool) -> None:
    events = [{"id": "up", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}],
               **({"usage": {"prompt_tokens": 30, "completion_tokens": 2 * n}} if upstream_usage else {})}
              for n, word in enumerate(["Once", " upon", " a"], 1)]
    stream = _Stalling(events)
    backend = OpenAIUpstreamBackend(await scripted(lambda request: httpx.Response(200, stream=stream)), [MODEL])
    async with running_node(home, backend) as (conn, node):
        reply_key, request = sealed(conn, "req_1", STORY)
        await conn.send(request)
        await conn.recv_type(protocol.InferenceAccepted)
        await conn.recv_chunks(reply_key, 3)
        report = await settle(conn, await cancel(conn, node, "req_1"))
        await asyncio.wait_for(stream.closed.wait(), 10)  # the backend closed the upstream connection
    expected = (30, 6) if upstream_usage else (_estimate_prompt_tokens(STORY), 3)
    assert (report.usage.prompt_tokens, report.usage.completion_tokens) == expected


@pytest.mark.parametrize("status, body, message", [
    (400, {"error": {"message": f"your prompt '{SECRET}' is too long", "type": "invalid_request_error",
                     "code": "context_length_exceeded"}},
     "the upstream rejected the request (400 invalid_request_error, context_length_exceeded)"),
    (500, f"<html>failed while answering {SECRET}</html>", "the upstream failed to serve the request (500)"),
    (200, f'data: {{"error": {{"message": "stopped after writing {SECRET}", "type": "server_error"}}}}\n\n',
     "the upstream failed mid-stream (server_error)"),
])
async def test_inference_error_never_carries_the_upstreams_text(home: Path, scripted: Scripted, status: int,
                                                               body: Any, message: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, **({"text": body} if isinstance(body, str) else {"json": body}))

    backend = OpenAIUpstreamBackend(await scripted(handler), [MODEL])
    async with running_node(home, backend) as (conn, _):
        await conn.send(sealed(conn, "req_1", {**STORY, "messages": [{"role": "user", "content": SECRET}]})[1])
        await conn.recv_type(protocol.InferenceAccepted)
        error = await conn.recv_type(protocol.InferenceError)
    assert (error.request_id, error.status_code, error.message) == ("req_1", status if status >= 400 else 502,
                                                                    message)
    assert all(SECRET not in protocol.dump(frame) for frame in conn.frames)
