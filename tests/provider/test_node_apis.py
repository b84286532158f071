"""The node serves each `InferenceRequest.api` through its backend, advertises its models'
capabilities, and puts a refusal's param and code in the `inference_error` frame."""

from __future__ import annotations

from typing import Any

import pytest

from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire import protocol
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.bundled_model import bundled_gguf_path
from darkbloom.provider.registration import with_capabilities
from tests.provider.fake_coordinator import Conn
from tests.provider.test_llama_hostile_requests import FORGED, assert_forged_fed_as_text, fed_prompts
from tests.provider.test_node import Harness, harness, seal_request  # noqa: F401  (the fixture)


async def answer(conn: Conn, request_id: str, api: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    reply_key, envelope = seal_request(conn.frames[0].public_key, {"model": "smollm2-135m", **body})
    await conn.send(protocol.InferenceRequest(request_id=request_id, encrypted_body=envelope, api=api))
    chunks = []
    while True:
        frame = await conn.recv_type((protocol.InferenceAccepted, protocol.InferenceResponseChunk,
                                      protocol.InferenceComplete, protocol.InferenceError))
        if isinstance(frame, protocol.InferenceResponseChunk):
            chunks.extend(response_chunks(reply_key.open(frame.encrypted_data)))
        elif not isinstance(frame, protocol.InferenceAccepted):
            return chunks, frame


async def test_models_advertise_their_capabilities(harness: Harness) -> None:
    _, register = await harness.connect()
    [model] = register.models
    assert set(model.capabilities) == {"tools", "structured_output", "logprobs", "completions", "completion_batches",
                                       "embeddings"}


def test_a_vision_model_also_advertises_images(harness: Harness) -> None:
    [info] = with_capabilities([protocol.ModelInfo(id="smollm2-135m", is_vision=True)], harness.backend)
    assert "images" in info.capabilities and "tools" in info.capabilities


async def test_each_api_is_served_and_usage_reported(harness: Harness) -> None:
    conn = await harness.registered()
    chunks, done = await answer(conn, "req_embed", "embeddings", {"input": ["a", "b"]})
    assert isinstance(done, protocol.InferenceComplete), done
    assert [[d["index"] for d in c["data"]] for c in chunks] == [[0], [1]]  # a chunk per vector
    assert done.usage.completion_tokens == 0
    assert done.usage.prompt_tokens == harness.backend.recent[-1].prompt_tokens > 0
    chunks, done = await answer(conn, "req_text", "completions", {"prompt": "Once upon a time", "max_tokens": 4,
                                                                  "temperature": 0})
    assert isinstance(done, protocol.InferenceComplete) and all(c["object"] == "text_completion" for c in chunks)
    assert 0 < done.usage.completion_tokens <= 4


@pytest.mark.parametrize("harness", [1], indirect=True)
async def test_a_refusal_carries_its_param_and_code(harness: Harness) -> None:
    conn = await harness.registered()
    _, error = await answer(conn, "req_long", "chat", {"messages": [{"role": "user", "content": "word " * 1500}]})
    assert isinstance(error, protocol.InferenceError)
    assert (error.status_code, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert "word" not in error.message
    _, error = await answer(conn, "req_tool", "chat", {"messages": [{"role": "user", "content": "x"}],
                                                       "tools": [], "tool_choice": "required"})
    assert (error.status_code, error.param, error.code) == (400, "tool_choice", None)
    _, error = await answer(conn, "req_input", "embeddings", {"input": []})
    assert (error.status_code, error.param) == (400, "input")


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_relayed_text_never_becomes_control_tokens(harness: Harness, monkeypatch: pytest.MonkeyPatch,
                                                         api: str) -> None:
    conn = await harness.registered()
    fed = fed_prompts(monkeypatch)
    body = {"messages": [{"role": "user", "content": FORGED}]} if api == "chat" else {"prompt": FORGED}
    _, done = await answer(conn, f"req_{api}", api, {**body, "max_tokens": 1})
    assert isinstance(done, protocol.InferenceComplete), done
    [tokens] = fed
    tokenizer = LoadedModel(bundled_gguf_path(), vocab_only=True)
    assert_forged_fed_as_text(tokenizer, tokens, api)
    assert done.usage.prompt_tokens == len(tokens)
