"""The OpenAI presenters (chat, legacy completions, embeddings): node chunks in, OpenAI's shapes out,
checked with the openai SDK's own models."""

from __future__ import annotations

import base64
import struct

import openai.types as oai
import pytest
from openai._models import construct_type
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.presenters import (ChatPresenter, CompletionsPresenter, EmbeddingsPresenter, api_id,
                                              float32_base64)
from darkbloom.wire.protocol import Usage
from tests.wire.node_chunks import (chat, completion, run_collect, run_stream, sse_events, text_chunks,
                                    tool_chunks)

REQUEST_ID = "chatcmpl-0123456789abcdef"
MODEL = "asked-model"


def test_api_id_keeps_our_random_part() -> None:
    assert api_id("chatcmpl-", REQUEST_ID) == REQUEST_ID
    assert api_id("resp_", REQUEST_ID) == "resp_0123456789abcdef"
    assert api_id("msg_", "msg_abc") == "msg_abc"
    assert api_id("toolu_", "").startswith("toolu_") and len(api_id("toolu_", "")) > 10


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_has_our_id_and_model_and_usage_only_on_request(include_usage: bool) -> None:
    request = {"model": MODEL, "stream": True, "stream_options": {"include_usage": include_usage}}
    events = sse_events(run_stream(ChatPresenter(REQUEST_ID, MODEL, request), text_chunks("Hel", "lo")))
    assert all(name is None for name, _ in events)
    assert events[-1][1] == "[DONE]" and [data for _, data in events].count("[DONE]") == 1
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in events[:-1]]
    assert all(c.id == REQUEST_ID and c.model == MODEL for c in chunks)
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.total_tokens) == (7, 12)
        chunks = chunks[:-1]
    assert all(c.choices for c in chunks)  # the classic `c.choices[0]` loop never breaks
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"


def test_chat_stream_opens_with_role_and_empty_content_as_openai_does() -> None:
    presenter = ChatPresenter(REQUEST_ID, MODEL, {"model": MODEL, "stream": True})
    events = sse_events(run_stream(presenter, [chat({"role": "assistant"}), chat({"content": "Hi"}), chat({}, "stop")]))
    assert events[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1][1]["choices"][0]["delta"] == {"content": "Hi"}
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    opening = chat({"role": "assistant", "tool_calls": [call]})
    calls = sse_events(run_stream(ChatPresenter(REQUEST_ID, MODEL, {}), [opening, chat({}, "tool_calls")]))
    assert calls[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": None, "tool_calls": [call]}


def test_chat_stream_error_is_one_error_event_and_no_done() -> None:
    presenter = ChatPresenter(REQUEST_ID, MODEL, {"model": MODEL, "stream": True})
    parts = presenter.stream_start() + presenter.stream_chunk(chat({"content": "Hi"}))
    parts += presenter.stream_error(ApiError(502, "provider_error", "The provider failed.", code="provider_error"))
    events = sse_events(parts)
    assert events[-1][1] == {"error": {"message": "The provider failed.", "type": "provider_error",
                                       "code": "provider_error", "param": None}}
    assert "[DONE]" not in [data for _, data in events]


def test_chat_collect_text() -> None:
    body = run_collect(ChatPresenter(REQUEST_ID, MODEL, {}), text_chunks("Hel", "lo"))
    completion_ = ChatCompletion.model_validate(body)
    assert completion_.id == REQUEST_ID and completion_.model == MODEL and completion_.object == "chat.completion"
    assert completion_.choices[0].message.content == "Hello" and completion_.choices[0].finish_reason == "stop"
    assert body["choices"][0]["logprobs"] is None and body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5,
                                                                       "total_tokens": 12,
                                                                       "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_collect_merges_tool_calls_by_index() -> None:
    chunks = tool_chunks(finish=None) + tool_chunks("get_time", ('{"tz": "UTC"}',), "call_def", 1, role=False)
    body = run_collect(ChatPresenter(REQUEST_ID, MODEL, {}), chunks)
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("call_abc123", "get_weather", '{"city": "Paris"}'), ("call_def", "get_time", '{"tz": "UTC"}')]


def test_chat_collect_legacy_function_call() -> None:
    chunks = [chat({"role": "assistant", "function_call": {"name": "f", "arguments": ""}}),
              chat({"function_call": {"arguments": '{"a": '}}), chat({"function_call": {"arguments": "1}"}}),
              chat({}, "function_call")]
    body = run_collect(ChatPresenter(REQUEST_ID, MODEL, {}), chunks)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.content is None
    assert choice.message.function_call is not None
    assert (choice.message.function_call.name, choice.message.function_call.arguments) == ("f", '{"a": 1}')


def test_chat_collect_concatenates_logprobs() -> None:
    def entry(token: str) -> dict[str, object]:
        return {"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": list(token.encode())}]}

    chunks = [chat({"content": "Hel"}, logprobs={"content": [entry("Hel")]}),
              chat({"content": "lo"}, logprobs={"content": [entry("lo")]}), chat({}, "length")]
    body = run_collect(ChatPresenter(REQUEST_ID, MODEL, {}), chunks)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "length" and choice.logprobs is not None
    assert [t.token for t in choice.logprobs.content or []] == ["Hel", "lo"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_completions_stream(include_usage: bool) -> None:
    request = {"model": MODEL, "prompt": "Once", "stream": True, "stream_options": {"include_usage": include_usage}}
    presenter = CompletionsPresenter(REQUEST_ID, MODEL, request)
    events = sse_events(run_stream(presenter, [completion(" upon"), completion(" a", "length")]))
    assert events[-1][1] == "[DONE]"
    # streamed chunks carry `finish_reason: null`, which the SDK's model admits only unvalidated, as
    # the SDK itself reads them
    chunks = [construct_type(type_=oai.Completion, value=data) for _, data in events[:-1]]
    assert all(c.id == "cmpl-0123456789abcdef" and c.object == "text_completion" and c.model == MODEL
               for c in chunks)
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 12
        chunks = chunks[:-1]
    assert [c.choices[0].text for c in chunks] == [" upon", " a"] and chunks[-1].choices[0].finish_reason == "length"


def test_a_batch_of_prompts_answers_one_choice_per_prompt_in_order() -> None:
    def at(index: int, text: str, finish: str | None = None) -> dict[str, object]:
        chunk = completion(text, finish)
        chunk["choices"][0]["index"] = index
        return chunk

    request = {"model": MODEL, "prompt": ["a", "b", "c"]}
    chunks = [at(0, "A"), at(0, "a", "stop"), at(2, "C", "length"), at(1, "B", "stop"), at(7, "stray")]
    parsed = oai.Completion.model_validate(run_collect(CompletionsPresenter(REQUEST_ID, MODEL, request), chunks))
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, "Aa", "stop"), (1, "B", "stop"), (2, "C", "length")]
    streamed = sse_events(run_stream(CompletionsPresenter(REQUEST_ID, MODEL, request), chunks[:4]))
    assert [data["choices"][0]["index"] for _, data in streamed[:-1]] == [0, 0, 2, 1]


def test_completions_collect_joins_text_and_logprobs() -> None:
    def lp(token: str, offset: int) -> dict[str, object]:
        return {"tokens": [token], "token_logprobs": [-1.0], "top_logprobs": [{token: -1.0}], "text_offset": [offset]}

    body = run_collect(CompletionsPresenter(REQUEST_ID, MODEL, {}),
                       [completion(" upon", logprobs=lp(" upon", 0)), completion(" a", "stop", lp(" a", 5))])
    parsed = oai.Completion.model_validate(body)
    assert parsed.choices[0].text == " upon a" and parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.tokens == [" upon", " a"]
    assert parsed.choices[0].logprobs.text_offset == [0, 5] and parsed.usage is not None
    no_logprobs = run_collect(CompletionsPresenter(REQUEST_ID, MODEL, {}), [completion("x", "stop")])
    assert no_logprobs["choices"][0]["logprobs"] is None


EMBEDDINGS = {"object": "list", "data": [{"object": "embedding", "index": 1, "embedding": [0.5, -2.0]},
                                         {"object": "embedding", "index": 0, "embedding": [1.0, 0.25]}]}


def test_embeddings_float_and_base64() -> None:
    usage = Usage(prompt_tokens=4, completion_tokens=0)
    body = run_collect(EmbeddingsPresenter("embd-1", MODEL, {"encoding_format": "float"}), [EMBEDDINGS], usage)
    parsed = oai.CreateEmbeddingResponse.model_validate(body)
    assert [d.embedding for d in parsed.data] == [[1.0, 0.25], [0.5, -2.0]] and parsed.model == MODEL
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    default = run_collect(EmbeddingsPresenter("embd-1", MODEL, {}), [EMBEDDINGS], usage)
    assert default == body
    encoded = run_collect(EmbeddingsPresenter("embd-1", MODEL, {"encoding_format": "base64"}), [EMBEDDINGS], usage)
    vectors = [struct.unpack("<2f", base64.b64decode(d["embedding"])) for d in encoded["data"]]
    assert vectors == [(1.0, 0.25), (0.5, -2.0)]
    assert float32_base64([1.0]) == base64.b64encode(struct.pack("<f", 1.0)).decode()


def test_embeddings_are_never_streamed() -> None:
    with pytest.raises(TypeError):
        EmbeddingsPresenter("embd-1", MODEL, {}).stream_start()


def test_openai_envelopes_for_errors() -> None:
    error = ApiError(400, "invalid_request_error", "Bad.", param="prompt")
    for presenter in (ChatPresenter(REQUEST_ID, MODEL, {}), CompletionsPresenter(REQUEST_ID, MODEL, {}),
                      EmbeddingsPresenter(REQUEST_ID, MODEL, {})):
        assert presenter.error_body(error) == {"error": {"message": "Bad.", "type": "invalid_request_error",
                                                         "code": "invalid_request_error", "param": "prompt"}}
