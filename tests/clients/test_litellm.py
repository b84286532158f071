"""litellm as a client (`openai/` prefix and `api_base`): completion (plain, streamed, with usage,
`response_format` from a pydantic model, a forced tool), text_completion (the legacy endpoint),
embedding, responses, and litellm's own exception classes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.clients.support import (COLOUR_SCHEMA, FORCE_WEATHER, MESSAGES, MODEL, PROMPT, WEATHER_PROMPT, WEATHER_SCHEMA,
                                   WEATHER_TOOL, Colour, Stack, cell, errors, valid)

pytestmark = pytest.mark.e2e

CLIENT = "litellm"
LITELLM_MODEL = f"openai/{MODEL}"


@pytest.fixture(scope="module")
def litellm() -> Any:
    import litellm  # imported late: the conftest has switched off its cost-map download by then

    litellm.telemetry = False
    return litellm


def options(stack: Stack, key: str | None = None) -> dict[str, Any]:
    return {"api_base": stack.api_url, "api_key": key or stack.key, "num_retries": 0, "max_retries": 0}


@cell(CLIENT, "chat")
def test_completion(stack: Stack, litellm: Any) -> None:
    response = litellm.completion(model=LITELLM_MODEL, messages=MESSAGES, max_tokens=12, **options(stack))
    assert isinstance(response.choices[0].message.content, str) and response.usage.completion_tokens > 0


@cell(CLIENT, "stream")
def test_completion_streamed(stack: Stack, litellm: Any) -> None:
    chunks = list(litellm.completion(model=LITELLM_MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                     **options(stack)))
    assert chunks and isinstance("".join(c.choices[0].delta.content or "" for c in chunks), str)


@cell(CLIENT, "usage")
def test_completion_streamed_with_usage(stack: Stack, litellm: Any) -> None:
    chunks = list(litellm.completion(model=LITELLM_MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                     stream_options={"include_usage": True}, **options(stack)))
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens > 0


@cell(CLIENT, "structured")
def test_response_format_from_a_pydantic_model(stack: Stack, litellm: Any) -> None:
    response = litellm.completion(model=LITELLM_MODEL, messages=MESSAGES, max_tokens=48, response_format=Colour,
                                  **options(stack))
    Colour.model_validate(valid(response.choices[0].message.content, COLOUR_SCHEMA))


@cell(CLIENT, "tool")
def test_forced_tool_call(stack: Stack, litellm: Any) -> None:
    response = litellm.completion(model=LITELLM_MODEL, max_tokens=64, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
                                  messages=[{"role": "user", "content": WEATHER_PROMPT}], **options(stack))
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    valid(call.function.arguments, WEATHER_SCHEMA)


@cell(CLIENT, "completions")
def test_text_completion(stack: Stack, litellm: Any) -> None:
    response = litellm.text_completion(model=LITELLM_MODEL, prompt="Once upon a time", max_tokens=8, **options(stack))
    assert isinstance(response.choices[0].text, str) and response.usage.completion_tokens > 0


@cell(CLIENT, "embeddings")
def test_embedding(stack: Stack, litellm: Any) -> None:
    response = litellm.embedding(model=LITELLM_MODEL, input=["red", "blue"], **options(stack))
    vectors = [item["embedding"] for item in response.data]
    assert len(vectors) == 2 and len(vectors[0]) > 0 and all(isinstance(x, float) for x in vectors[0])


@cell(CLIENT, "responses")
def test_responses(stack: Stack, litellm: Any) -> None:
    response = litellm.responses(model=LITELLM_MODEL, input=PROMPT, max_output_tokens=12, **options(stack))
    assert response.status in ("completed", "incomplete") and response.output


@cell(CLIENT, "responses-stream")
def test_responses_streamed(stack: Stack, litellm: Any) -> None:
    events = list(litellm.responses(model=LITELLM_MODEL, input=PROMPT, max_output_tokens=12, stream=True,
                                    **options(stack)))
    types = [str(getattr(event.type, "value", event.type)) for event in events]  # litellm's enum, or a str
    assert any(t.endswith("output_text.delta") for t in types), types
    assert types[-1].endswith(("response.completed", "response.incomplete")), types


@cell(CLIENT, "responses-tool")
def test_responses_forced_function_call(stack: Stack, litellm: Any) -> None:
    response = litellm.responses(model=LITELLM_MODEL, input=WEATHER_PROMPT, max_output_tokens=64, tool_choice="required",
                                 tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
                                 **options(stack))
    calls = [item for item in response.output if getattr(item, "type", None) == "function_call"]
    assert calls and calls[0].name == "get_weather"
    valid(calls[0].arguments, WEATHER_SCHEMA)


@pytest.mark.parametrize("status, error_name", errors(CLIENT, [
    ("401", "AuthenticationError"), ("404", "NotFoundError"), ("402", "APIError"), ("429", "RateLimitError")]))
def test_errors(stack: Stack, litellm: Any, status: str, error_name: str) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key, "429": stack.limited_key()}.get(status, stack.key)
    with pytest.raises(getattr(litellm, error_name)) as caught:
        litellm.completion(model="openai/no-such-model" if status == "404" else LITELLM_MODEL, messages=MESSAGES,
                           max_tokens=8, **options(stack, key))
    assert caught.value.status_code == int(status)
