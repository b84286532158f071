"""Every chunk's shape is checked where it opens (issue 19, row 6), and one frame carries at most
MAX_CHUNKS_PER_FRAME chunks (row 2): what would have reached a presenter as a value it cannot read
(a plain-text 500) is refused instead, and every presenter reads whatever passes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from darkbloom.wire.openai.anthropic_messages import MessagesPresenter
from darkbloom.wire.openai.chunk_shapes import chunk_problem
from darkbloom.wire.openai.presenters import ChatPresenter, CompletionsPresenter, EmbeddingsPresenter
from darkbloom.wire.openai.responses.presenter import ResponsesPresenter
from darkbloom.wire.openai.shaping import ChunkShaper
from darkbloom.wire.chunk_arrays import MAX_CHUNKS_PER_FRAME, response_chunks
from darkbloom.wire.protocol import Api, Usage


def _call(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **fields}]}}]}


MALFORMED: list[tuple[Api, dict[str, Any]]] = [
    ("chat", {"choices": 5}), ("chat", {"choices": [1, 2]}), ("chat", {"choices": [{"delta": "s"}]}),
    ("chat", {"choices": [{"delta": {"tool_calls": 7}}]}), ("chat", _call(index=[1])),
    ("chat", {"choices": [{"delta": {"content": 12345}}]}), ("chat", {"choices": [{"delta": {"refusal": []}}]}),
    ("chat", {"choices": [{"finish_reason": ["stop"]}]}), ("chat", _call(index=None)),
    ("chat", _call(id=5)), ("chat", _call(function="f")), ("chat", _call(function={"arguments": {"a": 1}})),
    ("chat", {"choices": [{"delta": {"function_call": {"name": 3}}}]}),
    ("chat", {"choices": [{"logprobs": {"content": "x"}}]}), ("chat", {"choices": [{"logprobs": 1}]}),
    ("completions", {"choices": [{"text": 5}]}), ("completions", {"choices": [{"logprobs": {"tokens": 3}}]}),
    ("embeddings", {"data": [{"index": "a", "embedding": [0.1]}]}), ("embeddings", {"data": 3}),
    ("embeddings", {"data": [{"index": -1, "embedding": [0.1]}]}), ("embeddings", {"data": ["x"]}),
    ("embeddings", {"data": [{"index": 0, "embedding": ["a"]}]}),
    ("embeddings", {"data": [{"index": 0, "embedding": [float("nan")]}]}),
    ("embeddings", {"data": [{"index": 0, "embedding": 0.5}]}),
]


@pytest.mark.parametrize("api,chunk", MALFORMED, ids=[json.dumps(c) for _, c in MALFORMED])
def test_a_malformed_chunk_is_named(api: Api, chunk: dict[str, Any]) -> None:
    assert chunk_problem(chunk, api) is not None


WELL_FORMED: list[tuple[Api, dict[str, Any]]] = [
    ("chat", {}), ("chat", {"choices": []}), ("chat", {"choices": [{"index": 0, "delta": {}, "finish_reason": None}]}),
    ("chat", {"choices": [{"delta": {"role": "assistant", "content": "hi", "refusal": None}}]}),
    ("chat", _call(id="call_1", type="function", function={"name": "f", "arguments": "{}"})),
    ("chat", {"choices": [{"delta": {"content": "x"}, "logprobs": {"content": [{"token": "x"}]}}]}),
    ("completions", {"choices": [{"text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-0.1]}}]}),
    ("embeddings", {"object": "list", "data": [{"index": 1, "embedding": [0.5, 1, -2.0]}], "model": "m"}),
]


def _presented(api: Api, chunk: dict[str, Any]) -> None:
    """What every presenter of the API does with a chunk, streamed and whole."""
    if api == "embeddings":
        presenter = EmbeddingsPresenter("embd-1", "m", {})
        presenter.collect(chunk)
        json.dumps(presenter.response(Usage(prompt_tokens=1, completion_tokens=0)), allow_nan=False)
        return
    kinds = [ChatPresenter, ResponsesPresenter, MessagesPresenter] if api == "chat" else [CompletionsPresenter]
    for kind in kinds:
        streamed, whole = kind("chatcmpl-1", "m", {}), kind("chatcmpl-1", "m", {})
        streamed.stream_start()
        streamed.stream_chunk(json.loads(json.dumps(chunk)))
        streamed.stream_end(Usage(prompt_tokens=1, completion_tokens=1))
        whole.collect(json.loads(json.dumps(chunk)))
        json.dumps(whole.response(Usage(prompt_tokens=1, completion_tokens=1)), allow_nan=False)


@pytest.mark.parametrize("api,chunk", WELL_FORMED, ids=[json.dumps(c) for _, c in WELL_FORMED])
def test_a_well_formed_chunk_passes_and_every_presenter_reads_it(api: Api, chunk: dict[str, Any]) -> None:
    assert chunk_problem(chunk, api) is None
    _presented(api, chunk)


def test_the_shapes_a_presenter_cannot_read_are_the_ones_refused() -> None:
    """Without the check, the row's chunks break a presenter (the 500 the issue saw)."""
    for api, chunk in MALFORMED[:6]:
        with pytest.raises((TypeError, AttributeError, ValueError)):
            _presented(api, chunk)
    ChunkShaper("chatcmpl-1", "m").chunk({})  # shaping itself reads nothing


def test_one_frame_carries_at_most_the_array_cap() -> None:
    assert len(response_chunks(json.dumps([{}] * MAX_CHUNKS_PER_FRAME).encode())) == MAX_CHUNKS_PER_FRAME
    with pytest.raises(ValueError, match="over the"):
        response_chunks(json.dumps([{}] * (MAX_CHUNKS_PER_FRAME + 1)).encode())


@pytest.mark.parametrize("plaintext", [
    b'{"x": [' + b",".join([b"[]"] * 70_000) + b"]}",  # one chunk, but parsing it would hold the loop
    b"[" + b",".join([b"{}"] * 800_000) + b"]",
])
def test_a_plaintext_of_too_many_objects_is_refused_unparsed(plaintext: bytes) -> None:
    with pytest.raises(ValueError, match="JSON objects and arrays"):
        response_chunks(plaintext)
