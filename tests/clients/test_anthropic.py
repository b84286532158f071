"""The anthropic SDK against the coordinator's /v1/messages (the key in `x-api-key`, as the SDK sends
it): plain, streamed, a forced tool use, `messages.count_tokens`, and its error classes with
Anthropic's error envelope."""

from __future__ import annotations

import anthropic
import pytest

from tests.clients.support import MODEL, PROMPT, WEATHER_PROMPT, WEATHER_SCHEMA, Stack, cell, errors, valid

pytestmark = pytest.mark.e2e

CLIENT = "anthropic"
ASK = [{"role": "user", "content": PROMPT}]


def sdk(stack: Stack, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key=key or stack.key, max_retries=0)


@cell(CLIENT, "messages")
def test_messages_create(stack: Stack) -> None:
    message = sdk(stack).messages.create(model=MODEL, max_tokens=12, system="Answer briefly.", messages=ASK)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.content and message.content[0].type == "text" and isinstance(message.content[0].text, str)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


@cell(CLIENT, "messages")
def test_count_tokens_and_the_cache_fields(stack: Stack) -> None:
    client = sdk(stack)
    counted = client.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=ASK)
    assert counted.input_tokens > 0
    longer = client.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=[
        {"role": "user", "content": PROMPT + " Then name another one, and say why."}])
    assert longer.input_tokens > counted.input_tokens
    message = client.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    # a node caches without being asked: nothing is written to a cache at a charge, and what it read
    # from one (this prompt may repeat an earlier test's) is outside input_tokens
    assert message.usage.cache_creation_input_tokens == 0 and message.usage.cache_read_input_tokens >= 0
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.count_tokens(model="no-such-model", messages=ASK)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"


@cell(CLIENT, "messages-stream")
def test_messages_stream(stack: Stack) -> None:
    with sdk(stack).messages.stream(model=MODEL, max_tokens=12, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens > 0


@cell(CLIENT, "messages-stream")
def test_messages_stream_event_types(stack: Stack) -> None:
    events = list(sdk(stack).messages.create(model=MODEL, max_tokens=12, messages=ASK, stream=True))
    types = [event.type for event in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(types)
    assert types.index("content_block_start") < types.index("content_block_stop") < types.index("message_delta")


@cell(CLIENT, "tool")
def test_forced_tool_use(stack: Stack) -> None:
    message = sdk(stack).messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather"})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and uses[0].id
    valid(uses[0].input, WEATHER_SCHEMA)


@pytest.mark.parametrize("status, error_class", errors(CLIENT, [
    ("401", anthropic.AuthenticationError), ("404", anthropic.NotFoundError), ("402", anthropic.APIStatusError),
    ("429", anthropic.RateLimitError)]))
def test_errors(stack: Stack, status: str, error_class: type[anthropic.APIStatusError]) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    with pytest.raises(error_class) as caught:
        sdk(stack, key).messages.create(model="no-such-model" if status == "404" else MODEL, max_tokens=8,
                                        messages=ASK)
    assert caught.value.status_code == int(status)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
