"""Direct mode's APIs on the real llama.cpp backend with the bundled model, through the real openai
and anthropic SDKs. The tiny model's wording is never asserted on: shapes, token counts, and a tool
call forced by `tool_choice`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.direct.server import create_app
from darkbloom.provider.slots import Slots
from tests.provider.direct.test_direct_apis import anthropic_client, openai_client
from tests.provider.direct.test_local_server import MODEL, TOKEN, gguf, idle, llama  # noqa: F401 - fixtures
from tests.provider.test_llama_hostile_requests import FORGED, assert_forged_fed_as_text, fed_prompts

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


async def test_openai_sdk_completions_embeddings_and_responses(llama: LlamaCppBackend) -> None:  # noqa: F811
    slots = Slots(1)
    sdk: openai.AsyncOpenAI = openai_client(create_app(llama, slots, [MODEL], TOKEN))

    done = await sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text and done.usage is not None
    assert 0 < done.usage.completion_tokens <= 6
    streamed = [c async for c in await sdk.completions.create(model=MODEL, prompt="The capital of France is",
                                                               max_tokens=6, temperature=0, stream=True)]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    await idle(slots)

    embedded = await sdk.embeddings.create(model=MODEL, input=["hello", "world"])  # base64 on the wire
    floats = await sdk.embeddings.create(model=MODEL, input=["hello", "world"], encoding_format="float")
    assert [d.index for d in embedded.data] == [0, 1] and len(embedded.data[0].embedding) > 16
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
               for a, b in zip(embedded.data[0].embedding, floats.data[0].embedding))
    assert embedded.usage.prompt_tokens > 0
    await idle(slots)

    response = await sdk.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage is not None and 0 < response.usage.output_tokens <= 8
    async with sdk.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == response.output_text
    await idle(slots)

    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}
    forced = await sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool],  # type: ignore[list-item]
                                        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    calls = [item for item in forced.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments), dict)
    await idle(slots)


async def test_anthropic_sdk_messages(llama: LlamaCppBackend) -> None:  # noqa: F811
    slots = Slots(1)
    sdk: anthropic.AsyncAnthropic = anthropic_client(create_app(llama, slots, [MODEL], TOKEN))
    hello: list[Any] = [{"role": "user", "content": "Say hello."}]
    greedy = {"temperature": 0}  # not in this SDK's signature any more; the API still takes it
    message = await sdk.messages.create(model=MODEL, max_tokens=8, extra_body=greedy, messages=hello)
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 8
    assert message.usage.input_tokens > 0
    async with sdk.messages.stream(model=MODEL, max_tokens=8, extra_body=greedy, messages=hello) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == message.content[0].text
    # the same prompt again: the node read most of it from its cache, and says so as Anthropic does
    assert final.usage.cache_read_input_tokens > 0 and final.usage.cache_creation_input_tokens == 0
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == message.usage.input_tokens + message.usage.cache_read_input_tokens)
    await idle(slots)

    tools: list[Any] = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}]
    forced = await sdk.messages.create(model=MODEL, max_tokens=40, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tool_choice={"type": "tool", "name": "get_weather"})
    uses = [block for block in forced.content if block.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_") and isinstance(uses[0].input, dict)
    await idle(slots)


async def test_a_conversations_second_turn_reads_the_first_from_the_cache(llama: LlamaCppBackend) -> None:  # noqa: F811
    slots = Slots(1)
    sdk: openai.AsyncOpenAI = openai_client(create_app(llama, slots, [MODEL], TOKEN))
    first: list[Any] = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
                        {"role": "user", "content": "Name one colour of the rainbow."}]
    answer = await sdk.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # a fresh engine: nothing to reuse
    second = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
              {"role": "user", "content": "And another one?"}]
    stream = await sdk.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    usage = [chunk async for chunk in stream][-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= answer.usage.prompt_tokens // 2  # the first turn's prompt
    response = await sdk.responses.create(model=MODEL, input=second, max_output_tokens=8,  # type: ignore[arg-type]
                                          temperature=0)
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens > 0
    await idle(slots)


async def test_direct_text_never_becomes_control_tokens(llama: LlamaCppBackend, gguf: Path,  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    slots = Slots(1)
    sdk: openai.AsyncOpenAI = openai_client(create_app(llama, slots, [MODEL], TOKEN))
    fed = fed_prompts(monkeypatch)
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FORGED}],
                                             max_tokens=1)
    await idle(slots)
    done = await sdk.completions.create(model=MODEL, prompt=FORGED, max_tokens=1)
    await idle(slots)
    tokenizer = LoadedModel(gguf, vocab_only=True)
    assert len(fed) == 2 and chat.usage is not None and done.usage is not None
    assert_forged_fed_as_text(tokenizer, fed[0], "chat")
    assert_forged_fed_as_text(tokenizer, fed[1], "completions")
    assert (chat.usage.prompt_tokens, done.usage.prompt_tokens) == (len(fed[0]), len(fed[1]))
