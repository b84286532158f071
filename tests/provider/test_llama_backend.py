"""The in-process llama.cpp backend on the bundled SmolLM2 GGUF (real model, small max_tokens)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
import pytest

from darkbloom.provider.backends.base import BackendError, UsageMeter
from darkbloom.provider.backends.in_process import _invalid_request_message
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.backends.llama_model import LoadedModel
from tests.support.recording_backend import RecordingLlamaCppBackend

LONG_STORY = [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]


pytestmark = pytest.mark.llama(max_concurrency=2, n_ctx=1024)  # the backend fixture's size (conftest)


async def collect(backend: LlamaCppBackend, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk async for chunk in backend.stream_chat("smollm2-135m", body)]


async def wait_for_records(backend: RecordingLlamaCppBackend, count: int) -> None:
    while len(backend.recent) < count:  # bounded by the test timeout, not asserted on
        await asyncio.sleep(0.01)


async def test_streamed_answer_ends_with_real_usage(backend: LlamaCppBackend) -> None:
    chunks = await collect(backend, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                                     "temperature": 0})
    *content, final = chunks
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "smollm2-135m" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert content[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text.strip()
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["choices"] == []
    usage = final["usage"]
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_usage_matches_the_library_non_streaming_count(backend: LlamaCppBackend, gguf: Path) -> None:
    """Our streamed counts equal what llama-cpp-python reports for the same non-streamed request."""
    body = {"messages": LONG_STORY, "max_tokens": 5, "temperature": 0}  # runs to the limit either way
    streamed = (await collect(backend, body))[-1]["usage"]
    llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, verbose=False)
    try:
        reference = await asyncio.to_thread(llama.create_chat_completion, **body)
    finally:
        llama.close()
    assert streamed == {**reference["usage"], "prompt_tokens_details": {"cached_tokens": 0}}


async def test_length_limit_counts_every_token(backend: LlamaCppBackend) -> None:
    chunks = await collect(backend, {"messages": LONG_STORY, "max_completion_tokens": 6, "temperature": 0})
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_two_concurrent_requests_are_decoded_in_the_same_steps(backend: RecordingLlamaCppBackend) -> None:
    bodies = [{"messages": [*LONG_STORY, {"role": "user", "content": f"Start with the number {n}."}],
               "max_tokens": 16} for n in (7, 42)]
    engine = backend._residency.engine("smollm2-135m", "chat")
    assert engine is not None
    before = engine.steps
    results = await asyncio.gather(*(collect(backend, body) for body in bodies))
    assert [chunks[-1]["usage"]["completion_tokens"] for chunks in results] == [16, 16]
    assert len(backend.recent) == 2
    assert engine.steps - before <= 30  # one after the other: at least 2 × (1 prompt step + 16) = 34


async def test_closing_the_stream_stops_generation(backend: RecordingLlamaCppBackend) -> None:
    stream = backend.stream_chat("smollm2-135m", {"messages": LONG_STORY, "max_tokens": 400, "temperature": 0})
    first = await stream.__anext__()
    assert first["choices"][0]["delta"] == {"role": "assistant"}
    await stream.aclose()
    await wait_for_records(backend, 1)
    [record] = backend.recent
    assert record.cancelled
    assert record.completion_tokens < 400  # this prompt runs to the 400-token limit when not cancelled
    # The instance is back in the pool: the next request is served.
    chunks = await collect(backend, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert chunks[-1]["usage"]["completion_tokens"] > 0


async def test_the_meter_counts_a_stopped_generation_once_the_worker_stops(backend: RecordingLlamaCppBackend) -> None:
    meter = UsageMeter()
    stream = backend.stream_chat("smollm2-135m", {"messages": LONG_STORY, "max_tokens": 400, "temperature": 0},
                                 meter)
    for _ in range(4):
        await stream.__anext__()
    assert meter.prompt_tokens > 5 and meter.completion_tokens >= 3  # counted as it goes
    await stream.aclose()
    assert await meter.stopped(10)
    [record] = backend.recent  # the worker has handed the instance back
    assert record.cancelled
    assert (meter.prompt_tokens, meter.completion_tokens) == (record.prompt_tokens, record.completion_tokens)
    assert 3 <= meter.completion_tokens < 400


async def test_the_meter_agrees_with_the_final_usage_chunk(backend: LlamaCppBackend) -> None:
    meter = UsageMeter()
    chunks = [c async for c in backend.stream_chat("smollm2-135m", {"messages": LONG_STORY, "max_tokens": 7}, meter)]
    usage = chunks[-1]["usage"]
    assert (meter.prompt_tokens, meter.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert await meter.stopped(0)


async def test_cancelling_the_consumer_task_stops_generation(backend: RecordingLlamaCppBackend) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in backend.stream_chat("smollm2-135m", {"messages": LONG_STORY, "max_tokens": 400,
                                                            "temperature": 0}):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_records(backend, 1)
    assert backend.recent[0].cancelled and backend.recent[0].completion_tokens < 400


@pytest.mark.parametrize("body, status, needle", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n must be 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text parts"),
    ({"messages": [{"role": "user", "content": "word " * 1500}], "max_tokens": 4}, 400,
     "too long for this model's context window of 1024"),
])
async def test_bad_requests_are_400(backend: LlamaCppBackend, body: dict[str, Any], status: int,
                                    needle: str) -> None:
    with pytest.raises(BackendError) as info:
        await collect(backend, body)
    assert info.value.status_code == status
    assert needle in info.value.message
    assert "word" not in info.value.message  # never the prompt


@pytest.mark.parametrize("exc, message", [
    (ValueError("Requested tokens (2000) exceed context window of 1024"),
     "the prompt is 2000 tokens, too long for this model's context window of 1024"),
    (jinja2.TemplateError("Conversation roles must alternate; got 'my secret plan'"),
     "this model's chat template rejected the messages (check the roles and their order)"),
    (ValueError("could not tokenize 'my secret plan'"), "the request is not valid for this model"),
    (TypeError("unexpected 'my secret plan'"), "the request is not valid for this model"),
])
def test_library_errors_become_our_own_sentences(exc: Exception, message: str) -> None:
    assert _invalid_request_message(exc) == message


async def test_unknown_model_is_404_and_unknown_params_are_ignored(backend: LlamaCppBackend) -> None:
    with pytest.raises(BackendError) as info:
        [c async for c in backend.stream_chat("nope", {"messages": [{"role": "user", "content": "x"}]})]
    assert info.value.status_code == 404
    chunks = await collect(backend, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                     "user": "u1", "metadata": {"a": 1},
                                     "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] > 0


async def test_models_load_without_extra_buffer_types_by_default(backend: LlamaCppBackend) -> None:
    engine = backend._residency.engine("smollm2-135m", "chat")
    assert engine is not None
    assert engine.model.params.use_extra_bufts is False  # decoding with them crashes on some VMs (AMX)
    assert llama_cpp.llama_model_default_params().use_extra_bufts is True  # the library itself is untouched


def test_extra_buffer_types_are_the_library_default_when_asked_for(gguf: Path) -> None:
    model = LoadedModel(gguf, vocab_only=True, extra_buffer_types=True)
    try:
        assert model.params.use_extra_bufts is True
    finally:
        model.close()
