"""Every API's answer carries the request's cost in its own usage object — whole, and in the stream's
usage event (chat and legacy completions: the `include_usage` chunk; Responses: `response.completed`;
Anthropic: `message_delta`) — when it is given one, 0 included; direct mode gives none and its answers
keep the usage objects they always had."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from darkbloom.wire.openai.anthropic_messages import MessagesPresenter
from darkbloom.wire.openai.presenters import ChatPresenter, CompletionsPresenter, EmbeddingsPresenter
from darkbloom.wire.openai.responses.presenter import ResponsesPresenter
from tests.wire.node_chunks import completion, run_collect, run_stream, sse_events, text_chunks

INCLUDE_USAGE = {"stream_options": {"include_usage": True}}
EMBEDDING = {"object": "list", "data": [{"index": 0, "embedding": [0.5, 0.25]}]}


def _chat_usage(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    usage_chunks = [data for _, data in events if isinstance(data, dict) and data.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == []
    return dict(usage_chunks[0]["usage"])


def _completed_usage(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    return dict(next(data for name, data in events if name == "response.completed")["response"]["usage"])


def _delta_usage(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    return dict(next(data for name, data in events if name == "message_delta")["usage"])


# (presenter, node chunks, the whole answer's usage, the stream's usage event)
STREAMED: list[tuple[Callable[[], Any], list[dict[str, Any]], Callable[[Any], dict[str, Any]]]] = [
    (lambda: ChatPresenter("chatcmpl-1", "m", INCLUDE_USAGE), text_chunks("Hi"), _chat_usage),
    (lambda: CompletionsPresenter("cmpl-1", "m", INCLUDE_USAGE), [completion("Hi", "stop")], _chat_usage),
    (lambda: ResponsesPresenter("resp_1", "m", {}), text_chunks("Hi"), _completed_usage),
    (lambda: MessagesPresenter("msg_1", "m", {}), text_chunks("Hi"), _delta_usage),
]
IDS = ["chat", "completions", "responses", "messages"]


@pytest.mark.parametrize("cost", [1234, 0])
@pytest.mark.parametrize(("make", "chunks", "_streamed"), STREAMED, ids=IDS)
def test_the_whole_answer_says_its_cost(make: Callable[[], Any], chunks: list[dict[str, Any]],
                                        _streamed: Any, cost: int) -> None:
    usage = run_collect(make(), chunks, cost_micro_usd=cost)["usage"]
    assert usage["cost_micro_usd"] == cost and isinstance(usage["cost_micro_usd"], int)


@pytest.mark.parametrize("cost", [1234, 0])
@pytest.mark.parametrize(("make", "chunks", "streamed"), STREAMED, ids=IDS)
def test_the_streams_usage_event_says_its_cost(make: Callable[[], Any], chunks: list[dict[str, Any]],
                                                streamed: Callable[[Any], dict[str, Any]], cost: int) -> None:
    assert streamed(sse_events(run_stream(make(), chunks, cost_micro_usd=cost)))["cost_micro_usd"] == cost


@pytest.mark.parametrize(("make", "chunks", "streamed"), STREAMED, ids=IDS)
def test_without_a_cost_the_usage_objects_are_as_before(make: Callable[[], Any], chunks: list[dict[str, Any]],
                                                        streamed: Callable[[Any], dict[str, Any]]) -> None:
    assert "cost_micro_usd" not in run_collect(make(), chunks)["usage"]
    assert "cost_micro_usd" not in streamed(sse_events(run_stream(make(), chunks)))


def test_embeddings_say_their_cost() -> None:
    usage = run_collect(EmbeddingsPresenter("embd-1", "m", {}), [EMBEDDING], cost_micro_usd=17)["usage"]
    assert usage == {"prompt_tokens": 7, "total_tokens": 7, "cost_micro_usd": 17}
    assert "cost_micro_usd" not in run_collect(EmbeddingsPresenter("embd-1", "m", {}), [EMBEDDING])["usage"]


def test_a_stream_without_include_usage_has_no_usage_chunk_to_carry_it() -> None:
    events = sse_events(run_stream(ChatPresenter("chatcmpl-1", "m", {}), text_chunks("Hi"), cost_micro_usd=5))
    assert all(data == "[DONE]" or data.get("usage") is None for _, data in events)
