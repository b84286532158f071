"""LangChain's ChatOpenAI: invoke, stream (with `stream_usage`), `with_structured_output` (its default
method, json_schema), `bind_tools` with a named `tool_choice`, the Responses API
(`use_responses_api=True`), and the openai error classes it raises; its `OpenAI` LLM (legacy
completions), whose `.batch()` and `.generate()` send a list of prompts in one request."""

from __future__ import annotations

from typing import Any, Literal

import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI

from tests.clients.support import MODEL, PROMPT, WEATHER_PROMPT, WEATHER_SCHEMA, Colour, Stack, cell, errors, valid

pytestmark = pytest.mark.e2e

CLIENT = "langchain"


@tool
def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
    """The weather in a city."""
    return "Sunny"


def llm(stack: Stack, key: str | None = None, **fields: Any) -> ChatOpenAI:
    fields.setdefault("max_tokens", 16)
    return ChatOpenAI(model=fields.pop("model", MODEL), base_url=stack.api_url, api_key=key or stack.key,
                      max_retries=0, **fields)


def forced_call(message: Any) -> None:
    assert isinstance(message, AIMessage) and message.tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    valid(call["args"], WEATHER_SCHEMA)


@cell(CLIENT, "chat")
def test_invoke(stack: Stack) -> None:
    message = llm(stack).invoke(PROMPT)
    assert isinstance(message.content, str) and message.usage_metadata["output_tokens"] > 0


@cell(CLIENT, "stream")
def test_stream(stack: Stack) -> None:
    chunks = list(llm(stack).stream(PROMPT))
    assert chunks and all(isinstance(c.content, str) for c in chunks)


@cell(CLIENT, "usage")
def test_stream_usage(stack: Stack) -> None:
    chunks = list(llm(stack, stream_usage=True).stream(PROMPT))
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert len(usage) == 1 and usage[0]["output_tokens"] > 0


@cell(CLIENT, "structured")
def test_with_structured_output_default_json_schema(stack: Stack) -> None:
    assert isinstance(llm(stack, max_tokens=48).with_structured_output(Colour).invoke(PROMPT), Colour)


@cell(CLIENT, "tool")
def test_bind_tools_with_a_named_tool_choice(stack: Stack) -> None:
    forced_call(llm(stack, max_tokens=64).bind_tools([get_weather], tool_choice="get_weather").invoke(WEATHER_PROMPT))


@cell(CLIENT, "tool")
def test_bind_tools_streamed(stack: Stack) -> None:
    chunks = list(llm(stack, max_tokens=64).bind_tools([get_weather], tool_choice="any").stream(WEATHER_PROMPT))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    forced_call(AIMessage(content="", tool_calls=whole.tool_calls))


@cell(CLIENT, "completions")
def test_completions_llm_batch_and_generate(stack: Stack) -> None:
    completions = OpenAI(model=MODEL, base_url=stack.api_url, api_key=stack.key, max_tokens=8, max_retries=0,
                         temperature=0)
    answers = completions.batch(["Once upon a time", "The sky is", "Roses are"])
    assert len(answers) == 3 and all(isinstance(answer, str) for answer in answers)
    result = completions.generate(["One, two,", "Once upon a time"])
    assert [len(generation) for generation in result.generations] == [1, 1]
    assert result.generations[1][0].text == answers[0]  # each prompt its own choice, in order
    usage = (result.llm_output or {})["token_usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 16
    assert isinstance(completions.invoke("The sky is"), str)


@cell(CLIENT, "responses")
def test_responses_invoke(stack: Stack) -> None:
    message = llm(stack, use_responses_api=True).invoke(PROMPT)
    assert isinstance(message.text, str) and message.usage_metadata["output_tokens"] > 0


@cell(CLIENT, "responses-stream")
def test_responses_stream(stack: Stack) -> None:
    chunks = list(llm(stack, use_responses_api=True).stream(PROMPT))
    assert chunks and isinstance("".join(c.text for c in chunks), str)


@cell(CLIENT, "responses-tool")
def test_responses_bind_tools(stack: Stack) -> None:
    model = llm(stack, use_responses_api=True, max_tokens=64).bind_tools([get_weather], tool_choice="get_weather")
    forced_call(model.invoke(WEATHER_PROMPT))


@cell(CLIENT, "structured", "responses")
def test_responses_structured_output(stack: Stack) -> None:
    model = llm(stack, use_responses_api=True, max_tokens=48).with_structured_output(Colour)
    assert isinstance(model.invoke(PROMPT), Colour)


@pytest.mark.parametrize("status, error_class", errors(CLIENT, [
    ("401", openai.AuthenticationError), ("404", openai.NotFoundError), ("402", openai.APIStatusError),
    ("429", openai.RateLimitError)]))
def test_errors(stack: Stack, status: str, error_class: type[openai.APIStatusError]) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    with pytest.raises(error_class) as caught:
        llm(stack, key, model="no-such-model" if status == "404" else MODEL, max_tokens=8).invoke(PROMPT)
    assert caught.value.status_code == int(status)
