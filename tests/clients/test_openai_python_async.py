"""openai-python's AsyncOpenAI: the same features through the async client (its own streaming and
parsing code paths)."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from tests.clients.support import (FORCE_WEATHER, MESSAGES, MODEL, PROMPT, WEATHER_PROMPT, WEATHER_SCHEMA, WEATHER_TOOL,
                                   Colour, Stack, cell, errors, valid)

pytestmark = pytest.mark.e2e

CLIENT = "openai-python-async"


def sdk(stack: Stack, key: str | None = None) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=stack.api_url, api_key=key or stack.key, max_retries=0)


@cell(CLIENT, "chat")
async def test_chat(stack: Stack) -> None:
    reply = await sdk(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert reply.object == "chat.completion" and isinstance(reply.choices[0].message.content, str)
    assert reply.usage.completion_tokens > 0


@cell(CLIENT, "stream", "usage")
async def test_stream_classic_loop(stack: Stack) -> None:
    stream = await sdk(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True)
    pieces = [c.choices[0].delta.content or "" async for c in stream]
    assert pieces


@cell(CLIENT, "usage")
async def test_include_usage(stack: Stack) -> None:
    stream = await sdk(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                                      stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


@cell(CLIENT, "structured")
async def test_parse(stack: Stack) -> None:
    reply = await sdk(stack).chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=48,
                                                    response_format=Colour)
    assert isinstance(reply.choices[0].message.parsed, Colour)


@cell(CLIENT, "tool")
async def test_forced_tool_call_through_the_stream_helper(stack: Stack) -> None:
    """`client.chat.completions.stream(...)` assembles the streamed tool-call deltas itself."""
    strict = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}  # the helper parses strict tools
    async with sdk(stack).chat.completions.stream(model=MODEL, max_tokens=64, tools=[strict],  # type: ignore[list-item]
                                                  tool_choice=FORCE_WEATHER,  # type: ignore[arg-type]
                                                  messages=[{"role": "user", "content": WEATHER_PROMPT}]) as stream:
        final = await stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    valid(call.function.arguments, WEATHER_SCHEMA)


@cell(CLIENT, "responses")
async def test_responses(stack: Stack) -> None:
    response = await sdk(stack).responses.create(model=MODEL, input=PROMPT, max_output_tokens=12)
    assert response.status in ("completed", "incomplete") and isinstance(response.output_text, str)


@cell(CLIENT, "responses-stream")
async def test_responses_stream(stack: Stack) -> None:
    stream = await sdk(stack).responses.create(model=MODEL, input=PROMPT, max_output_tokens=12, stream=True)
    types = [event.type async for event in stream]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")


@cell(CLIENT, "responses-tool")
async def test_responses_tool(stack: Stack) -> None:
    response = await sdk(stack).responses.create(
        model=MODEL, input=WEATHER_PROMPT, max_output_tokens=64, tool_choice="required",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}])
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    valid(calls[0].arguments, WEATHER_SCHEMA)


@cell(CLIENT, "completions")
async def test_completions(stack: Stack) -> None:
    completion = await sdk(stack).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert completion.object == "text_completion" and isinstance(completion.choices[0].text, str)


@cell(CLIENT, "embeddings")
async def test_embeddings(stack: Stack) -> None:
    embedding = await sdk(stack).embeddings.create(model=MODEL, input="red")
    assert len(embedding.data[0].embedding) > 0 and all(isinstance(x, float) for x in embedding.data[0].embedding)


@pytest.mark.parametrize("status, error_class", errors(CLIENT, [
    ("401", openai.AuthenticationError), ("404", openai.NotFoundError), ("402", openai.APIStatusError),
    ("429", openai.RateLimitError)]))
async def test_errors(stack: Stack, status: str, error_class: type[openai.APIStatusError]) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    with pytest.raises(error_class) as caught:
        await sdk(stack, key).chat.completions.create(model="no-such-model" if status == "404" else MODEL,
                                                      messages=MESSAGES, max_tokens=8)
    assert caught.value.status_code == int(status)
