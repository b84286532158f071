"""pydantic-ai on its OpenAI provider with `base_url`: text output, streaming, the default tool output
for a pydantic `output_type` (a forced output tool), NativeOutput (json_schema), a function tool,
the Responses model, and ModelHTTPError."""

from __future__ import annotations

from typing import Literal

import pytest
from openai import AsyncOpenAI
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.exceptions import ModelHTTPError, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

from tests.clients.support import MODEL, PROMPT, WEATHER_PROMPT, WEATHER_SCHEMA, Colour, Stack, Weather, cell, errors, valid

pytestmark = pytest.mark.e2e

CLIENT = "pydantic-ai"


def settings(max_tokens: int = 16) -> ModelSettings:
    return ModelSettings(max_tokens=max_tokens)


def chat(stack: Stack) -> OpenAIChatModel:
    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=stack.api_url, api_key=stack.key))


def responses(stack: Stack) -> OpenAIResponsesModel:
    return OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=stack.api_url, api_key=stack.key))


@cell(CLIENT, "chat")
async def test_text_output(stack: Stack) -> None:
    result = await Agent(chat(stack), model_settings=settings()).run(PROMPT)
    assert isinstance(result.output, str) and result.usage.output_tokens > 0


@cell(CLIENT, "stream", "usage")
async def test_run_stream(stack: Stack) -> None:
    async with Agent(chat(stack), model_settings=settings()).run_stream(PROMPT) as run:
        pieces = [text async for text in run.stream_text(delta=True)]
        usage = run.usage
    assert isinstance("".join(pieces), str) and usage.output_tokens > 0


@cell(CLIENT, "tool")
async def test_pydantic_output_type_is_a_forced_output_tool(stack: Stack) -> None:
    result = await Agent(chat(stack), output_type=Weather, model_settings=settings(64)).run(WEATHER_PROMPT)
    assert isinstance(result.output, Weather)


@cell(CLIENT, "tool")
async def test_function_tool(stack: Stack) -> None:
    cities: list[str] = []
    agent = Agent(chat(stack), output_type=Weather, model_settings=settings(64))

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "Sunny"

    try:
        result = await agent.run(WEATHER_PROMPT, usage_limits=UsageLimits(request_limit=4))
    except UsageLimitExceeded:
        # the tiny model may ask for the weather again and again (each turn sampled beside other tests'
        # requests in the node's batch, so not always the same turn): the calls it made are what is tested
        assert cities
    else:
        assert isinstance(result.output, Weather)
    for city in cities:
        valid({"city": city}, WEATHER_SCHEMA)


@cell(CLIENT, "structured")
async def test_native_output(stack: Stack) -> None:
    result = await Agent(chat(stack), output_type=NativeOutput(Colour), model_settings=settings(48)).run(PROMPT)
    assert isinstance(result.output, Colour)


@cell(CLIENT, "responses")
async def test_responses_model(stack: Stack) -> None:
    result = await Agent(responses(stack), model_settings=settings()).run(PROMPT)
    assert isinstance(result.output, str)


@cell(CLIENT, "responses-stream")
async def test_responses_model_streamed(stack: Stack) -> None:
    async with Agent(responses(stack), model_settings=settings()).run_stream(PROMPT) as run:
        assert isinstance("".join([text async for text in run.stream_text(delta=True)]), str)


@cell(CLIENT, "responses-tool")
async def test_responses_model_output_tool(stack: Stack) -> None:
    result = await Agent(responses(stack), output_type=Weather, model_settings=settings(64)).run(WEATHER_PROMPT)
    assert isinstance(result.output, Weather)


@pytest.mark.parametrize("status", errors(CLIENT, ["401", "404", "402", "429"]))
async def test_errors(stack: Stack, status: str) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    # an SDK client without retries (it would retry the 429); the provider takes it instead of base_url
    client = AsyncOpenAI(base_url=stack.api_url, api_key=key, max_retries=0)
    model = OpenAIChatModel("no-such-model" if status == "404" else MODEL, provider=OpenAIProvider(openai_client=client))
    with pytest.raises(ModelHTTPError) as caught:
        await Agent(model, model_settings=settings(8)).run(PROMPT)
    assert caught.value.status_code == int(status)
