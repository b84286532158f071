"""openai-python (sync): chat, streaming, usage, `.parse()`, forced tool calls, Responses, legacy
completions, embeddings and the SDK's error classes, against the real coordinator and node."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
from openai import OpenAI

from tests.clients.support import (COLOUR_FORMAT, COLOUR_SCHEMA, FORCE_WEATHER, MESSAGES, MODEL, PROMPT, WEATHER_PROMPT,
                                   WEATHER_SCHEMA, WEATHER_TOOL, Colour, Stack, Weather, cell, errors, valid)

pytestmark = pytest.mark.e2e

CLIENT = "openai-python"
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                  "parameters": WEATHER_SCHEMA, "strict": True}


def sdk(stack: Stack, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=stack.api_url, api_key=key or stack.key, max_retries=0)


@cell(CLIENT, "chat")
def test_chat(stack: Stack) -> None:
    raw = sdk(stack).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    reply = raw.parse()
    assert reply.object == "chat.completion" and reply.model == MODEL and reply.id == raw.headers["x-request-id"]
    assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0
    assert raw.headers["x-darkbloom-billing"] == "charged"


@cell(CLIENT, "stream", "usage")
def test_stream_classic_loop_without_include_usage(stack: Stack) -> None:
    """`for c in stream: print(c.choices[0].delta.content or "")` must not raise."""
    stream = sdk(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream]
    assert pieces and isinstance("".join(pieces), str)


@cell(CLIENT, "usage")
def test_include_usage_gives_one_final_usage_chunk(stack: Stack) -> None:
    stream = sdk(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True})
    chunks = list(stream)
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens > 0 and all(c.choices for c in chunks[:-1])


@cell(CLIENT, "structured")
def test_parse_with_a_pydantic_model(stack: Stack) -> None:
    reply = sdk(stack).chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=48, response_format=Colour)
    assert isinstance(reply.choices[0].message.parsed, Colour)


@cell(CLIENT, "structured")
def test_json_schema_response_format(stack: Stack) -> None:
    reply = sdk(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48,
                                               response_format=COLOUR_FORMAT)  # type: ignore[arg-type]
    valid(reply.choices[0].message.content, COLOUR_SCHEMA)


@cell(CLIENT, "structured", "responses")
def test_responses_parse_with_text_format(stack: Stack) -> None:
    response = sdk(stack).responses.parse(model=MODEL, input=PROMPT, max_output_tokens=48, text_format=Colour)
    assert isinstance(response.output_parsed, Colour)


@cell(CLIENT, "tool")
def test_named_tool_choice_forces_a_call(stack: Stack) -> None:
    reply = sdk(stack).chat.completions.create(model=MODEL, max_tokens=64, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                               tool_choice=FORCE_WEATHER,  # type: ignore[arg-type]
                                               messages=[{"role": "user", "content": WEATHER_PROMPT}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    valid(call.function.arguments, WEATHER_SCHEMA)


@cell(CLIENT, "tool")
def test_parse_with_a_strict_pydantic_tool(stack: Stack) -> None:
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    reply = sdk(stack).chat.completions.parse(model=MODEL, max_tokens=64, tools=[tool], tool_choice="required",
                                              messages=[{"role": "user", "content": WEATHER_PROMPT}])
    assert isinstance(reply.choices[0].message.tool_calls[0].function.parsed_arguments, Weather)


@cell(CLIENT, "tool")
def test_streamed_tool_call_deltas(stack: Stack) -> None:
    stream = sdk(stack).chat.completions.create(model=MODEL, max_tokens=64, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                                tool_choice="required", stream=True,
                                                messages=[{"role": "user", "content": WEATHER_PROMPT}])
    chunks = list(stream)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    valid("".join(d.function.arguments or "" for d in deltas if d.index == 0), WEATHER_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@cell(CLIENT, "tool")
def test_tool_result_round_trip(stack: Stack) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    reply = sdk(stack).chat.completions.create(model=MODEL, max_tokens=12, tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                               messages=[{"role": "user", "content": WEATHER_PROMPT},
                                                         {"role": "assistant", "content": None, "tool_calls": [call]},
                                                         {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}])
    assert reply.choices[0].message.role == "assistant"


@cell(CLIENT, "responses")
def test_responses_create(stack: Stack) -> None:
    response = sdk(stack).responses.create(model=MODEL, input=PROMPT, instructions="Answer briefly.",
                                           max_output_tokens=12)
    assert response.object == "response" and response.model == MODEL
    assert response.status == "completed" or response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"] and isinstance(response.output_text, str)
    assert response.usage.output_tokens > 0
    items = sdk(stack).responses.create(model=MODEL, max_output_tokens=12,
                                        input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    assert items.status in ("completed", "incomplete")


@cell(CLIENT, "responses")
def test_responses_store_is_refused_naming_it(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(stack).responses.create(model=MODEL, input=PROMPT, store=True, max_output_tokens=8)
    assert refused.value.param == "store"


@cell(CLIENT, "responses-stream")
def test_responses_stream(stack: Stack) -> None:
    with sdk(stack).responses.stream(model=MODEL, input=PROMPT, max_output_tokens=12) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types and "response.output_item.done" in types
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.usage.output_tokens > 0


@cell(CLIENT, "responses-stream")
def test_responses_stream_cut_by_max_output_tokens(stack: Stack) -> None:
    """An answer stopped by `max_output_tokens` is `status: "incomplete"` (reason `max_output_tokens`);
    its stream still ends with `response.completed` (wire/openai/responses/presenter.py says why: the
    SDK's stream helper takes the final response only from that event), so get_final_response works."""
    with sdk(stack).responses.stream(model=MODEL, input="Tell me a long story.", max_output_tokens=4) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 4


@cell(CLIENT, "responses-tool")
def test_responses_forced_function_call_and_its_output(stack: Stack) -> None:
    client = sdk(stack)
    response = client.responses.create(model=MODEL, input=WEATHER_PROMPT, max_output_tokens=64, tools=[RESPONSES_TOOL],
                                       tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    valid(calls[0].arguments, WEATHER_SCHEMA)
    follow_up = client.responses.create(model=MODEL, max_output_tokens=12, tools=[RESPONSES_TOOL], input=[
        {"role": "user", "content": WEATHER_PROMPT},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}])
    assert follow_up.status in ("completed", "incomplete")


@cell(CLIENT, "completions")
def test_legacy_completions(stack: Stack) -> None:
    completion = sdk(stack).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert completion.object == "text_completion" and completion.model == MODEL
    assert isinstance(completion.choices[0].text, str) and completion.usage.completion_tokens > 0
    stream = sdk(stack).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True)
    assert isinstance("".join(c.choices[0].text for c in stream), str)


@cell(CLIENT, "embeddings")
def test_embeddings_base64_default_and_float(stack: Stack) -> None:
    client = sdk(stack)
    default = client.embeddings.create(model=MODEL, input=["red", "blue"])  # the SDK asks for base64
    floats = client.embeddings.create(model=MODEL, input="red", encoding_format="float")
    assert [d.index for d in default.data] == [0, 1] and default.usage.prompt_tokens > 0
    assert len(default.data[0].embedding) == len(floats.data[0].embedding) > 0
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, rel=1e-5, abs=1e-6)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input="red", encoding_format="base64").parse()
    packed = base64.b64decode(raw.data[0].embedding)  # type: ignore[arg-type]
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(floats.data[0].embedding, rel=1e-5)


@pytest.mark.parametrize("status, error_class, code", errors(CLIENT, [
    ("401", openai.AuthenticationError, "invalid_api_key"), ("404", openai.NotFoundError, "model_not_found"),
    ("402", openai.APIStatusError, "insufficient_quota"), ("429", openai.RateLimitError, "rate_limit_exceeded")]))
def test_errors(stack: Stack, status: str, error_class: type[openai.APIStatusError], code: str) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    model = "no-such-model" if status == "404" else MODEL
    with pytest.raises(error_class) as caught:
        sdk(stack, key).chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
    assert caught.value.status_code == int(status) and caught.value.code == code
    retry = caught.value.response.headers.get("x-should-retry")
    assert retry == (None if status == "429" else "false"), retry
