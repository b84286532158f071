"""openai-agents: the default Agent (the Responses API) with Runner.run and Runner.run_streamed, a
function tool forced by `tool_choice="required"`, `output_type` (structured output), and the chat
completions model; tracing is off (it would export to api.openai.com)."""

from __future__ import annotations

from typing import Any, Literal

import openai
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIProvider, RunConfig, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from tests.clients.support import MODEL, PROMPT, WEATHER_PROMPT, WEATHER_SCHEMA, Colour, Stack, cell, errors, valid

pytestmark = pytest.mark.e2e

CLIENT = "openai-agents"
set_tracing_disabled(True)


def run_config(stack: Stack, key: str | None = None) -> RunConfig:
    client = AsyncOpenAI(base_url=stack.api_url, api_key=key or stack.key, max_retries=0)
    return RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)


def weather_agent(calls: list[dict[str, Any]], **fields: Any) -> Agent[Any]:
    @function_tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append({"city": city})
        return f"Sunny in {city}"

    return Agent(name="weather", instructions="Use the tool.", tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                 model_settings=ModelSettings(tool_choice="required", max_tokens=64), **fields)


# a greedy answer with room to end on its own: openai-agents fails a response cut by max_output_tokens
# (as it would on OpenAI), and the tiny model's answer to PROMPT ends well within this
FINISHES = ModelSettings(max_tokens=400, temperature=0.0)


@cell(CLIENT, "responses")
async def test_default_agent_runs_on_responses(stack: Stack) -> None:
    agent = Agent(name="plain", instructions="Answer briefly.", model=MODEL, model_settings=FINISHES)
    result = await Runner.run(agent, PROMPT, run_config=run_config(stack))
    assert isinstance(result.final_output, str)
    assert result.context_wrapper.usage.output_tokens > 0


@cell(CLIENT, "responses-stream")
async def test_run_streamed(stack: Stack) -> None:
    agent = Agent(name="plain", model=MODEL, model_settings=FINISHES)
    result = Runner.run_streamed(agent, PROMPT, run_config=run_config(stack))
    raw = [event.data.type async for event in result.stream_events() if event.type == "raw_response_event"]
    assert raw[0] == "response.created" and raw[-1] in ("response.completed", "response.incomplete")
    assert isinstance(result.final_output, str)


@cell(CLIENT, "responses-tool")
async def test_function_tool_forced_by_tool_choice(stack: Stack) -> None:
    calls: list[dict[str, Any]] = []
    result = await Runner.run(weather_agent(calls, model=MODEL), WEATHER_PROMPT, run_config=run_config(stack))
    assert len(calls) == 1 and valid(calls[0], WEATHER_SCHEMA)
    assert result.final_output == f"Sunny in {calls[0]['city']}"


@cell(CLIENT, "structured")
async def test_output_type(stack: Stack) -> None:
    agent = Agent(name="colour", model=MODEL, output_type=Colour, model_settings=ModelSettings(max_tokens=48))
    result = await Runner.run(agent, PROMPT, run_config=run_config(stack))
    assert isinstance(result.final_output, Colour)


def chat_model(stack: Stack) -> OpenAIChatCompletionsModel:
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=stack.api_url, api_key=stack.key,
                                                                             max_retries=0))


@cell(CLIENT, "chat")
async def test_chat_completions_model(stack: Stack) -> None:
    agent = Agent(name="plain", model=chat_model(stack), model_settings=ModelSettings(max_tokens=16))
    result = await Runner.run(agent, PROMPT, run_config=RunConfig(tracing_disabled=True))
    assert isinstance(result.final_output, str)


@cell(CLIENT, "stream", "usage")
async def test_chat_completions_model_streamed_with_usage(stack: Stack) -> None:
    agent = Agent(name="plain", model=chat_model(stack), model_settings=ModelSettings(max_tokens=16, include_usage=True))
    result = Runner.run_streamed(agent, PROMPT, run_config=RunConfig(tracing_disabled=True))
    events = [event async for event in result.stream_events()]
    assert events and isinstance(result.final_output, str)
    assert result.context_wrapper.usage.output_tokens > 0


@cell(CLIENT, "tool")
async def test_chat_completions_model_forced_tool(stack: Stack) -> None:
    calls: list[dict[str, Any]] = []
    await Runner.run(weather_agent(calls, model=chat_model(stack)), WEATHER_PROMPT,
                     run_config=RunConfig(tracing_disabled=True))
    assert len(calls) == 1 and valid(calls[0], WEATHER_SCHEMA)


@pytest.mark.parametrize("status", errors(CLIENT, ["401", "404", "402", "429"]))
async def test_errors(stack: Stack, status: str) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    agent = Agent(name="plain", model="no-such-model" if status == "404" else MODEL,
                  model_settings=ModelSettings(max_tokens=8))
    with pytest.raises(openai.APIStatusError) as caught:
        await Runner.run(agent, PROMPT, run_config=run_config(stack, key))
    assert caught.value.status_code == int(status)
