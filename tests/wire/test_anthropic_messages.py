"""The Anthropic Messages edge: request translation (and each 400 with its param), the `message`
answer and its event stream, and Anthropic's error envelope, checked with the anthropic SDK's own
models and stream accumulator."""

from __future__ import annotations

from typing import Any

import anthropic.types as at
import pytest
from pydantic import TypeAdapter

from darkbloom.wire.openai.anthropic_messages import MessagesPresenter, anthropic_error_body
from darkbloom.wire.openai.anthropic_request import messages_prompt, messages_to_chat
from darkbloom.wire.openai.errors import ApiError
from tests.wire.node_chunks import chat, run_collect, run_stream, sse_events, text_chunks, tool_chunks

MODEL = "smollm2-135m"
EVENTS: TypeAdapter[Any] = TypeAdapter(at.RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def translate(**body: Any) -> dict[str, Any]:
    return messages_to_chat({"model": MODEL, "max_tokens": 32, **body})


HI = [{"role": "user", "content": "Hi"}]


def test_plain_request() -> None:
    assert translate(system="Be brief.", messages=[{"role": "user", "content": "Hi"}], temperature=0.5, top_p=0.9,
                     top_k=40, stop_sequences=["\n\n"], stream=True, metadata={"user_id": "u"}) == {
        "model": MODEL, "max_tokens": 32, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": ["\n\n"],
        "stream": True, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


def test_blocks_images_and_system_blocks() -> None:
    body = translate(system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"}]},
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
            {"type": "text", "text": "Both?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Cats."}]},
    ])
    assert body["messages"] == [
        {"role": "system", "content": "One.\n\nTwo."},
        {"role": "user", "content": "What is this?"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            {"type": "text", "text": "Both?"}]},
        {"role": "assistant", "content": "Cats."},
    ]


def test_tool_use_and_tool_result_round_trip() -> None:
    body = translate(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ])
    assert body["messages"][1:] == [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Weather in a city"}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False


def test_output_config_format_is_structured_output() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = translate(messages=HI, output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}
    assert "response_format" not in translate(messages=HI, output_config={"effort": "low"})


@pytest.mark.parametrize("given, sent", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice(given: dict[str, Any], sent: Any) -> None:
    body = translate(tools=[WEATHER], tool_choice=given, messages=[{"role": "user", "content": "Hi"}])
    assert body["tool_choice"] == sent and "parallel_tool_calls" not in body


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"model": ""}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": 3}, "system"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"stop_sequences": "\n"}, "stop_sequences"),
    ({"output_config": "json"}, "output_config"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
])
def test_refusals_name_their_param(change: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        messages_to_chat({"model": MODEL, "max_tokens": 32, "messages": HI, **change})
    assert (caught.value.status, caught.value.param) == (400, param)
    assert anthropic_error_body(caught.value)["error"]["type"] == "invalid_request_error"


def test_the_prompt_part_needs_no_max_tokens_and_is_what_the_request_sends() -> None:
    body = {"model": MODEL, "system": "Be brief.", "messages": HI,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}], "temperature": 0.5}
    prompt = messages_prompt(body)
    assert set(prompt) == {"model", "messages", "tools"} and prompt["messages"][0]["role"] == "system"
    assert {k: v for k, v in messages_to_chat({**body, "max_tokens": 8}).items()
            if k in prompt} == prompt


def test_message_with_text() -> None:
    body = run_collect(MessagesPresenter("msg_abc", MODEL, {}), text_chunks("Hel", "lo"))
    message = at.Message.model_validate(body)
    assert message.id == "msg_abc" and message.model == MODEL and message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == ["text"] and body["content"][0]["text"] == "Hello"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 5) and message.stop_sequence is None
    assert (message.usage.cache_read_input_tokens, message.usage.cache_creation_input_tokens) == (0, 0)


@pytest.mark.parametrize("finish, reason", [("length", "max_tokens"), ("content_filter", "refusal")])
def test_stop_reasons(finish: str, reason: str) -> None:
    body = run_collect(MessagesPresenter("msg_abc", MODEL, {}), text_chunks("Hel", finish=finish))
    assert at.Message.model_validate(body).stop_reason == reason


def test_message_with_tool_use() -> None:
    chunks = text_chunks("Checking.")[:-1] + tool_chunks(role=False)
    message = at.Message.model_validate(run_collect(MessagesPresenter("msg_abc", MODEL, {}), chunks))
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["text", "tool_use"]
    tool = message.content[1]
    assert isinstance(tool, at.ToolUseBlock) and tool.id == "toolu_abc123" and tool.name == "get_weather"
    assert tool.input == {"city": "Paris"}


def test_a_forced_tool_call_ending_with_stop_is_tool_use() -> None:
    chunks = tool_chunks(finish="stop")
    assert run_collect(MessagesPresenter("msg_abc", MODEL, {}), chunks)["stop_reason"] == "tool_use"


def stream(chunks: list[dict[str, Any]]) -> list[tuple[str | None, Any]]:
    events = sse_events(run_stream(MessagesPresenter("msg_abc", MODEL, {}), chunks))
    for name, data in events:
        assert name == data["type"]
        if name != "ping":  # the SDK skips pings before parsing
            EVENTS.validate_python(data)
    return events


def accumulate(events: list[tuple[str | None, Any]]) -> at.Message:
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for name, data in events:
        if name != "ping":
            snapshot = accumulate_event(event=EVENTS.validate_python(data), current_snapshot=snapshot,
                                        json_bufs=json_bufs)
    assert snapshot is not None
    return snapshot


def test_streamed_text_event_sequence() -> None:
    events = stream(text_chunks("Hel", "lo"))
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    no_cache = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert events[0][1]["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0, **no_cache}
    assert events[6][1]["delta"]["stop_reason"] == "end_turn"
    assert events[6][1]["usage"] == {"input_tokens": 7, "output_tokens": 5, **no_cache}
    message = accumulate(events)
    assert message.content[0].type == "text" and message.content[0].text == "Hello"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 5


def test_streamed_tool_use() -> None:
    events = stream(text_chunks("Checking.")[:-1] + tool_chunks(role=False))
    assert [name for name, _ in events][2:] == [
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[5][1]
    assert start["index"] == 1 and start["content_block"] == {"type": "tool_use", "id": "toolu_abc123",
                                                              "name": "get_weather", "input": {}}
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": '}
    message = accumulate(events)
    assert message.stop_reason == "tool_use" and isinstance(message.content[1], at.ToolUseBlock)
    assert message.content[1].input == {"city": "Paris"}


def test_a_stream_failure_is_an_error_event() -> None:
    presenter = MessagesPresenter("msg_abc", MODEL, {})
    parts = presenter.stream_start() + presenter.stream_chunk(chat({"content": "Hi"}))
    parts += presenter.stream_error(ApiError(502, "provider_error", "The provider failed."))
    name, data = sse_events(parts)[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "api_error",
                                                                   "message": "The provider failed."}}


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (402, "billing_error"),
    (403, "permission_error"), (404, "not_found_error"), (409, "invalid_request_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
    (503, "overloaded_error"), (504, "timeout_error"), (529, "overloaded_error"),
])
def test_error_envelope(status: int, kind: str) -> None:
    body = MessagesPresenter("msg_abc", MODEL, {}).error_body(ApiError(status, "x", "Something."))
    assert body == {"type": "error", "error": {"type": kind, "message": "Something."}}
    if kind != "request_too_large":  # Anthropic's documented 413 type, missing from the SDK's union
        at.ErrorResponse.model_validate(body)
