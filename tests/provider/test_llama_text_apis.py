"""Legacy completions, embeddings, context overflow and capabilities on the llama.cpp backend
(the bundled SmolLM2), with exact usage compared against llama-cpp-python's own counts."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, AsyncIterator

import llama_cpp
import pytest

from darkbloom.provider.backends.base import BackendError, UsageMeter
from darkbloom.provider.backends.streams import open_stream
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.wire.protocol import CAPABILITIES
from tests.support.recording_backend import RecordingLlamaCppBackend

MODEL = "smollm2-135m"
STORY = "Once upon a time, in a lighthouse by the sea, there lived"


pytestmark = pytest.mark.llama(max_concurrency=1, n_ctx=512)  # the backend fixture's size (conftest)


async def collect(backend: LlamaCppBackend, api: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk async for chunk in open_stream(backend, api, MODEL, body)]  # type: ignore[arg-type]


def test_capabilities(backend: LlamaCppBackend) -> None:
    assert backend.capabilities(MODEL) == {"tools", "structured_output", "logprobs", "completions", "embeddings"}
    assert backend.capabilities(MODEL) <= CAPABILITIES and backend.capabilities("other") == frozenset()


def chat_model(backend: LlamaCppBackend) -> LoadedModel:
    engine = backend._residency.engine(MODEL, "chat")
    assert engine is not None
    return engine.model


async def test_completion_streams_text_completion_chunks_with_exact_usage(backend: LlamaCppBackend,
                                                                          gguf: Path) -> None:
    body = {"prompt": STORY, "max_tokens": 12, "temperature": 0}
    *chunks, final = await collect(backend, "completions", body)
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in [*chunks, final]}) == 1
    assert all(set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason"} for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert final["choices"] == [] and final["object"] == "text_completion"
    llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, flash_attn=True, verbose=False)
    try:  # the library's own completion (with flash attention, as the engine's context has it)
        reference = await asyncio.to_thread(llama.create_completion, **body)
    finally:
        llama.close()
    assert text == reference["choices"][0]["text"]
    assert {k: final["usage"][k] for k in reference["usage"]} == reference["usage"]


async def test_completion_token_prompt_stop_and_logprobs(backend: LlamaCppBackend) -> None:
    llama = chat_model(backend)
    tokens = llama.tokenize(STORY.encode(), add_bos=True, special=True)
    chunks = await collect(backend, "completions", {"prompt": [tokens], "max_tokens": 5, "temperature": 0,
                                                    "logprobs": 2})
    assert chunks[-1]["usage"]["prompt_tokens"] == len(tokens)
    content = [c for c in chunks[:-1] if c["choices"][0]["text"]]
    for chunk in content:
        lp = chunk["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert "".join(lp["tokens"]) == chunk["choices"][0]["text"]
        assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp["top_logprobs"])
    assert content[0]["choices"][0]["logprobs"]["text_offset"][0] == len(STORY)
    text = "".join(c["choices"][0]["text"] for c in content)
    stopped = await collect(backend, "completions", {"prompt": STORY, "max_tokens": 5, "temperature": 0,
                                                     "stop": text[2:4]})
    assert "".join(c["choices"][0]["text"] for c in stopped[:-1]) == text[:text.index(text[2:4])]
    assert stopped[-2]["choices"][0]["finish_reason"] == "stop"


async def test_embeddings_dimension_determinism_lists_and_token_ids(backend: LlamaCppBackend) -> None:
    [data, usage] = await collect(backend, "embeddings", {"input": "a lighthouse"})
    assert data["object"] == "list" and "usage" not in data
    [item] = data["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    vector = item["embedding"]
    llama = chat_model(backend)
    assert len(vector) == llama.n_embd() and all(isinstance(v, float) for v in vector)
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-6)
    tokens = llama.tokenize(b"a lighthouse", add_bos=True, special=False)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(tokens)
    assert usage["usage"]["completion_tokens"] == 0
    first, second, _ = await collect(backend, "embeddings", {"input": ["a lighthouse", "the sea"]})  # a chunk each
    assert [d["index"] for d in first["data"] + second["data"]] == [0, 1]
    assert first["data"][0]["embedding"] == pytest.approx(vector, abs=1e-5)
    assert second["data"][0]["embedding"] != pytest.approx(vector, abs=1e-3)
    [by_ids, ids_usage] = await collect(backend, "embeddings", {"input": tokens})
    assert by_ids["data"][0]["embedding"] == pytest.approx(vector, abs=1e-5)
    *two, two_usage = await collect(backend, "embeddings", {"input": [tokens, tokens[:2]]})
    assert len(two) == 2 and two_usage["usage"]["prompt_tokens"] == len(tokens) + 2
    assert ids_usage["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize("api, body, param", [
    ("embeddings", {"input": ""}, "input"),
    ("embeddings", {"input": []}, "input"),
    ("embeddings", {"input": [[]]}, "input"),
    ("embeddings", {"input": [1, "x"]}, "input"),
    ("embeddings", {"input": [[10**9]]}, "input"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "logprobs": 9}, "logprobs"),
    ("completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
async def test_bad_requests_name_their_param(backend: LlamaCppBackend, api: str, body: dict[str, Any],
                                             param: str) -> None:
    with pytest.raises(BackendError) as info:
        await collect(backend, api, body)
    assert (info.value.status_code, info.value.param) == (400, param)


@pytest.mark.parametrize("api, body, param", [
    ("chat", {"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ("completions", {"prompt": "word " * 600}, "prompt"),
    ("embeddings", {"input": ["short", "word " * 600]}, "input"),
])
async def test_context_overflow_is_context_length_exceeded(backend: LlamaCppBackend, api: str,
                                                           body: dict[str, Any], param: str) -> None:
    with pytest.raises(BackendError) as info:
        await collect(backend, api, body)
    error = info.value
    assert (error.status_code, error.code, error.param) == (400, "context_length_exceeded", param)
    assert "context window of 512" in error.message and "word" not in error.message


async def test_a_stopped_completion_reports_the_tokens_used(backend: RecordingLlamaCppBackend) -> None:
    meter = UsageMeter()
    stream = open_stream(backend, "completions", MODEL, {"prompt": STORY, "max_tokens": 300, "temperature": 0},
                         meter)
    for _ in range(3):
        await stream.__anext__()
    await stream.aclose()
    assert await meter.stopped(10)
    [record] = backend.recent
    assert record.cancelled and (meter.prompt_tokens, meter.completion_tokens) == (record.prompt_tokens,
                                                                                   record.completion_tokens)
    assert 3 <= meter.completion_tokens < 300


async def test_a_stopped_tool_call_reports_the_tokens_used(backend: RecordingLlamaCppBackend) -> None:
    tool = {"type": "function", "function": {"name": "story", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    meter = UsageMeter()
    stream = open_stream(backend, "chat", MODEL, {
        "messages": [{"role": "user", "content": "Write a very long story."}], "tools": [tool],
        "tool_choice": "required", "max_tokens": 300, "temperature": 0}, meter)
    async for chunk in stream:
        if chunk["choices"] and chunk["choices"][0]["delta"].get("tool_calls"):
            break
    await stream.aclose()
    assert await meter.stopped(10)
    [record] = backend.recent
    assert record.cancelled and meter.completion_tokens == record.completion_tokens < 300


async def test_an_api_the_backend_lacks_is_400(backend: LlamaCppBackend) -> None:
    class ChatOnly:
        async def stream_chat(self, *args: Any) -> AsyncIterator[dict[str, Any]]:
            yield {}

    with pytest.raises(BackendError) as info:
        open_stream(ChatOnly(), "embeddings", MODEL, {"input": "x"})  # type: ignore[arg-type]
    assert (info.value.status_code, info.value.param) == (400, "model")


async def test_a_batch_of_prompts_runs_each_in_turn_with_its_index_and_summed_usage(
        backend: LlamaCppBackend) -> None:
    prompts = [STORY, "The capital of France is", [1, 2, 3]]
    singles = [await collect(backend, "completions", {"prompt": p, "max_tokens": 6, "temperature": 0})
               for p in prompts]
    *chunks, final = await collect(backend, "completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    indices = [c["choices"][0]["index"] for c in chunks]
    assert indices == sorted(indices) and set(indices) == {0, 1, 2}
    for index, single in enumerate(singles):
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
        assert text == "".join(c["choices"][0]["text"] for c in single[:-1])
    assert final["choices"] == [] and final["object"] == "text_completion"
    for field in ("prompt_tokens", "completion_tokens"):
        assert final["usage"][field] == sum(single[-1]["usage"][field] for single in singles)


async def test_a_stopped_batch_reports_what_all_its_prompts_used(backend: RecordingLlamaCppBackend) -> None:
    meter = UsageMeter()
    stream = open_stream(backend, "completions", MODEL, {"prompt": ["Hello", STORY], "max_tokens": 300,
                                                         "temperature": 0}, meter)
    async for chunk in stream:
        if chunk["choices"][0]["index"] == 1:
            break
    await stream.aclose()
    assert await meter.stopped(10)
    first, second = backend.recent[-2:]
    assert second.cancelled and not first.cancelled
    assert meter.prompt_tokens == first.prompt_tokens + second.prompt_tokens
    assert meter.completion_tokens == first.completion_tokens + second.completion_tokens


async def test_a_batch_whose_later_prompt_overflows_fails_after_the_earlier_ones(
        backend: RecordingLlamaCppBackend) -> None:
    """A prompt the node refuses part-way through a batch ends the stream with its error (the chunks
    already sent stay sent, as with any failure after the first content); the meter keeps what the
    prompts before it used, and nothing more is generated."""
    meter, before = UsageMeter(), len(backend.recent)
    sent: list[dict[str, Any]] = []
    body = {"prompt": [STORY, "word " * 600, "The capital of France is"], "max_tokens": 6, "temperature": 0}
    with pytest.raises(BackendError) as info:
        async for chunk in open_stream(backend, "completions", MODEL, body, meter):
            sent.append(chunk)
    assert (info.value.status_code, info.value.code) == (400, "context_length_exceeded")
    assert sent and {c["choices"][0]["index"] for c in sent} == {0}
    first, *refused = backend.recent[before:]  # the refused one may still be on its way back; the third never ran
    assert len(refused) <= 1 and all((r.prompt_tokens, r.completion_tokens) == (0, 0) for r in refused)
    assert (meter.prompt_tokens, meter.completion_tokens) == (first.prompt_tokens, first.completion_tokens) != (0, 0)
