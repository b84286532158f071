"""Hostile requests against a real node process (`darkbloom serve`, llama.cpp on the bundled model,
max_concurrency 1), driven by the test's own coordinator end of the socket (issue 19 rows 1 and 3).

Row 1: a 38-byte schema (`maxLength` 20,000) killed the node with SIGSEGV in llama.cpp's grammar
parser, as a response format, a tool parameter under `tool_choice: required`, an array's `maxItems`
or a Responses `text.format`: now each is a 400 naming the bound, and the same process serves on.
Row 3: 100,000 tiny messages (or a Responses input of 50,000 items) kept a node tokenizing for
minutes and deaf to SIGTERM: now a 400 at once, the one slot free for the next request, and the node
stops promptly on SIGTERM even mid-prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire import crypto, protocol
from tests.provider.fake_coordinator import Conn, FakeCoordinator
from tests.support.processes import Process, darkbloom_cmd, spawn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Say hello."}]
RF = "response_format.json_schema.schema"


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}


@contextlib.asynccontextmanager
async def node_process(home: Path) -> AsyncIterator[tuple[Conn, Process]]:
    async with FakeCoordinator() as fake:
        node = spawn(darkbloom_cmd("serve", "--coordinator", fake.url, "--max-concurrency", "1"), home, "node.log")
        try:
            conn = await fake.accept(timeout=120)
            await conn.recv_type(protocol.Register, timeout=60)
            await conn.send(protocol.Registered(provider_id="prov_test", trust_level="self_signed"))
            yield conn, node
        finally:
            node.stop()


async def ask(conn: Conn, request_id: str, body: dict[str, Any], api: protocol.Api = "chat",
              timeout: float = 60) -> tuple[list[dict[str, Any]], Any]:
    """Send a sealed request; its opened chunks and the frame that ends it (complete or error)."""
    reply = crypto.ReplyKey()
    envelope = reply.seal_request(json.dumps({"model": MODEL, **body}).encode(),
                                  crypto.public_key_from_b64(conn.frames[0].public_key))
    await conn.send(protocol.InferenceRequest(request_id=request_id, encrypted_body=envelope, api=api))
    chunks: list[dict[str, Any]] = []
    while True:
        frame = await conn.recv(timeout)
        if getattr(frame, "request_id", request_id) != request_id:
            continue
        if isinstance(frame, protocol.InferenceResponseChunk):
            chunks += response_chunks(reply.open(frame.encrypted_data))
        elif isinstance(frame, (protocol.InferenceComplete, protocol.InferenceError)):
            return chunks, frame


async def served(conn: Conn, request_id: str) -> None:
    chunks, done = await ask(conn, request_id, {"messages": ASK, "max_tokens": 4, "temperature": 0})
    assert isinstance(done, protocol.InferenceComplete), done
    assert chunks and done.usage.completion_tokens > 0


POISON = [
    ({"response_format": schema_format({"type": "string", "maxLength": 20_000})}, f"{RF}.maxLength"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 30_000}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.properties.q.maxLength"),
    ({"response_format": schema_format({"type": "array", "items": {"type": "integer"}, "maxItems": 50_000})},
     f"{RF}.maxItems"),
    # a Responses `text.format` reaches the node as the chat response_format it is translated to
    ({"response_format": schema_format({"type": "string", "pattern": "^a{1,40000}$"})}, f"{RF}.pattern"),
]


async def test_poison_schemas_are_400_naming_the_bound_and_the_node_serves_on(tmp_path: Path) -> None:
    async with node_process(tmp_path / "home") as (conn, node):
        for index, (body, param) in enumerate(POISON):
            body = {"messages": ASK, "max_tokens": 8, **body}
            _, done = await ask(conn, f"req_poison_{index}", body)
            assert isinstance(done, protocol.InferenceError), done
            assert (done.status_code, done.param) == (400, param)
            assert node.proc.poll() is None, node.log()
            await served(conn, f"req_after_{index}")
        assert "Segmentation" not in node.log()


async def test_too_many_messages_or_inputs_are_400_at_once_and_the_slot_is_free(tmp_path: Path) -> None:
    floods: list[tuple[protocol.Api, dict[str, Any], str, str | None]] = [
        ("chat", {"messages": [{"role": "user", "content": "x"}] * 100_000}, "messages", "context_length_exceeded"),
        # a Responses input of 50,000 items: the chat messages it is translated to
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 50_000},
         "messages", "context_length_exceeded"),
        ("embeddings", {"input": ["x"] * 50_000}, "input", None),
    ]
    async with node_process(tmp_path / "home") as (conn, node):
        for index, (api, body, param, code) in enumerate(floods):
            # bounded before tokenizing: the refusal comes at once (tokenizing these took minutes)
            _, done = await ask(conn, f"req_flood_{index}", {"max_tokens": 4, **body}, api, timeout=30)
            assert isinstance(done, protocol.InferenceError), done
            assert (done.status_code, done.param, done.code) == (400, param, code)
            await served(conn, f"req_next_{index}")  # max_concurrency 1: the slot is free again
        assert node.proc.poll() is None


async def test_sigterm_mid_prefill_stops_the_node_promptly(tmp_path: Path) -> None:
    async with node_process(tmp_path / "home") as (conn, node):
        await served(conn, "req_warm")
        reply = crypto.ReplyKey()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1900}], "max_tokens": 100}
        envelope = reply.seal_request(json.dumps(body).encode(), crypto.public_key_from_b64(conn.frames[0].public_key))
        await conn.send(protocol.InferenceRequest(request_id="req_long", encrypted_body=envelope))
        await conn.recv_type(protocol.InferenceAccepted)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        while node.proc.poll() is None:
            assert time.monotonic() - started < 15, "the node ignored SIGTERM"
            await asyncio.sleep(0.05)
        assert "node stopped" in node.log()
