"""instructor on the openai SDK: the default TOOLS mode (a forced tool call for the response model),
partial streaming of it, JSON_SCHEMA mode (response_format json_schema), and the errors it raises."""

from __future__ import annotations

import instructor
import openai
import pytest
from openai import OpenAI

from tests.clients.support import MESSAGES, MODEL, WEATHER_PROMPT, Colour, Stack, Weather, cell, errors

pytestmark = pytest.mark.e2e

CLIENT = "instructor"
ASK_WEATHER = [{"role": "user", "content": WEATHER_PROMPT}]


def client(stack: Stack, key: str | None = None, mode: instructor.Mode = instructor.Mode.TOOLS) -> instructor.Instructor:
    return instructor.from_openai(OpenAI(base_url=stack.api_url, api_key=key or stack.key, max_retries=0), mode=mode)


@cell(CLIENT, "tool")
def test_tools_mode_response_model(stack: Stack) -> None:
    weather = client(stack).chat.completions.create(model=MODEL, response_model=Weather, messages=ASK_WEATHER,
                                                    max_tokens=64, max_retries=1)
    assert isinstance(weather, Weather)


@cell(CLIENT, "chat")
def test_without_a_response_model_is_plain_chat(stack: Stack) -> None:
    completion = client(stack).chat.completions.create(model=MODEL, response_model=None, messages=MESSAGES,
                                                       max_tokens=12)
    assert isinstance(completion.choices[0].message.content, str)


@cell(CLIENT, "tool")
def test_tools_mode_with_completion(stack: Stack) -> None:
    weather, completion = client(stack).chat.completions.create_with_completion(
        model=MODEL, response_model=Weather, messages=ASK_WEATHER, max_tokens=64, max_retries=1)
    assert isinstance(weather, Weather) and completion.choices[0].message.tool_calls[0].function.name == "Weather"
    assert completion.usage.completion_tokens > 0


@cell(CLIENT, "stream")
def test_create_partial_streams_the_tool_call(stack: Stack) -> None:
    partials = list(client(stack).chat.completions.create_partial(model=MODEL, response_model=Weather,
                                                                  messages=ASK_WEATHER, max_tokens=64, max_retries=1))
    assert partials and Weather.model_validate(partials[-1].model_dump())


@cell(CLIENT, "structured")
def test_json_schema_mode(stack: Stack) -> None:
    colour = client(stack, mode=instructor.Mode.JSON_SCHEMA).chat.completions.create(
        model=MODEL, response_model=Colour, messages=MESSAGES, max_tokens=48, max_retries=1)
    assert isinstance(colour, Colour)


@pytest.mark.parametrize("status", errors(CLIENT, ["401", "404", "402", "429"]))
def test_errors(stack: Stack, status: str) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    with pytest.raises(Exception) as caught:
        client(stack, key).chat.completions.create(model="no-such-model" if status == "404" else MODEL,
                                                   response_model=Weather, messages=ASK_WEATHER, max_tokens=8,
                                                   max_retries=1)
    error = caught.value
    # instructor raises the SDK's error, or its own retry error wrapping it
    cause = error if isinstance(error, openai.APIStatusError) else error.__cause__ or error.__context__
    assert isinstance(cause, openai.APIStatusError), repr(error)
    assert cause.status_code == int(status)
