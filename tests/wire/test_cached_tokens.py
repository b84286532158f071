"""Every answer says how many of its prompt tokens the node read from its cache (docs/api.md "Cached
prompt tokens"), in its API's own usage object, whole and in the stream's usage event, 0 when none —
checked with the official SDKs' models; embeddings say nothing of it."""

from __future__ import annotations

from typing import Any, Callable

import anthropic.types as at
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from darkbloom.wire.openai.anthropic_messages import MessagesPresenter
from darkbloom.wire.openai.presenters import ChatPresenter, CompletionsPresenter, EmbeddingsPresenter
from darkbloom.wire.openai.responses.presenter import ResponsesPresenter
from darkbloom.wire.protocol import Usage
from tests.wire.node_chunks import completion, run_collect, run_stream, sse_events, text_chunks

INCLUDE_USAGE = {"stream_options": {"include_usage": True}}
CACHED = Usage(prompt_tokens=40, completion_tokens=5, cached_tokens=32)
NONE_CACHED = Usage(prompt_tokens=40, completion_tokens=5)


def _chat_cached(usage: dict[str, Any]) -> int:
    assert usage["prompt_tokens"] == 40 and usage["total_tokens"] == 45
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def _responses_cached(usage: dict[str, Any]) -> int:
    assert usage["input_tokens"] == 40 and usage["total_tokens"] == 45
    return int(usage["input_tokens_details"]["cached_tokens"])


def _anthropic_cached(usage: dict[str, Any]) -> int:
    """Anthropic's convention: `input_tokens` are the others, their sum the prompt."""
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == 40
    assert usage["cache_creation_input_tokens"] == 0 and usage["output_tokens"] == 5
    return int(usage["cache_read_input_tokens"])


def _chat_stream_usage(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    [chunk] = [data for _, data in events if isinstance(data, dict) and data.get("usage")]
    (Completion if chunk["object"] == "text_completion" else ChatCompletionChunk).model_validate(chunk)
    return dict(chunk["usage"])


def _completed_usage(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    return dict(next(data for name, data in events if name == "response.completed")["response"]["usage"])


def _delta_usage(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    return dict(next(data for name, data in events if name == "message_delta")["usage"])


# (presenter, node chunks, the SDK's model of the whole answer, its cached tokens, the stream's usage)
APIS: list[tuple[Callable[[], Any], list[dict[str, Any]], Callable[[dict[str, Any]], Any],
                 Callable[[dict[str, Any]], int], Callable[[Any], dict[str, Any]]]] = [
    (lambda: ChatPresenter("chatcmpl-1", "m", INCLUDE_USAGE), text_chunks("Hi"), ChatCompletion.model_validate,
     _chat_cached, _chat_stream_usage),
    (lambda: CompletionsPresenter("cmpl-1", "m", INCLUDE_USAGE), [completion("Hi", "stop")], Completion.model_validate,
     _chat_cached, _chat_stream_usage),
    (lambda: ResponsesPresenter("resp_1", "m", {}), text_chunks("Hi"), Response.model_validate, _responses_cached,
     _completed_usage),
    (lambda: MessagesPresenter("msg_1", "m", {}), text_chunks("Hi"), at.Message.model_validate, _anthropic_cached,
     _delta_usage),
]
IDS = ["chat", "completions", "responses", "messages"]


@pytest.mark.parametrize("usage, cached", [(CACHED, 32), (NONE_CACHED, 0)], ids=["cached", "none"])
@pytest.mark.parametrize(("make", "chunks", "parse", "cached_of", "_streamed"), APIS, ids=IDS)
def test_the_whole_answer_says_its_cached_tokens(make: Callable[[], Any], chunks: list[dict[str, Any]],
                                                 parse: Callable[[dict[str, Any]], Any],
                                                 cached_of: Callable[[dict[str, Any]], int], _streamed: Any,
                                                 usage: Usage, cached: int) -> None:
    body = run_collect(make(), chunks, usage, cost_micro_usd=7)
    parse(body)  # the SDK's own model of the answer reads it
    assert cached_of(body["usage"]) == cached and body["usage"]["cost_micro_usd"] == 7


@pytest.mark.parametrize("usage, cached", [(CACHED, 32), (NONE_CACHED, 0)], ids=["cached", "none"])
@pytest.mark.parametrize(("make", "chunks", "_parse", "cached_of", "streamed"), APIS, ids=IDS)
def test_the_streams_usage_event_says_its_cached_tokens(make: Callable[[], Any], chunks: list[dict[str, Any]],
                                                        _parse: Any, cached_of: Callable[[dict[str, Any]], int],
                                                        streamed: Callable[[Any], dict[str, Any]],
                                                        usage: Usage, cached: int) -> None:
    assert cached_of(streamed(sse_events(run_stream(make(), chunks, usage)))) == cached


def test_the_sdks_read_the_figures() -> None:
    chat = ChatCompletion.model_validate(run_collect(ChatPresenter("chatcmpl-1", "m", {}), text_chunks("Hi"), CACHED))
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 32
    response = Response.model_validate(run_collect(ResponsesPresenter("resp_1", "m", {}), text_chunks("Hi"), CACHED))
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 32
    message = at.Message.model_validate(run_collect(MessagesPresenter("msg_1", "m", {}), text_chunks("Hi"), CACHED))
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (8, 32)


def test_anthropics_message_start_knows_nothing_yet() -> None:
    events = sse_events(run_stream(MessagesPresenter("msg_1", "m", {}), text_chunks("Hi"), CACHED))
    assert events[0][1]["message"]["usage"] == {"input_tokens": 0, "cache_creation_input_tokens": 0,
                                                "cache_read_input_tokens": 0, "output_tokens": 0}


def test_embeddings_say_nothing_of_a_cache() -> None:
    embedding = {"object": "list", "data": [{"index": 0, "embedding": [0.5]}]}
    body = run_collect(EmbeddingsPresenter("embd-1", "m", {}), [embedding], Usage(prompt_tokens=4, completion_tokens=0))
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
