"""The admission bounds: the prompt bound is never below the real token count of the bundled model
(llama.cpp's own tokenizer after the model's chat template, and the llama.cpp backend's own
rendering of tools and schemas), and the output bound follows the request, capped by the catalog."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

import llama_cpp
from llama_cpp import llama_chat_format

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.money import billing
from darkbloom.coordinator.inference.calls import output_token_bound, parse_call, prompt_token_bound
from darkbloom.wire.openai.edges import CHAT
from darkbloom.provider.backends.llama_chat import chat_job
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.llama_prompt import chat_prompt
from darkbloom.provider.bundled_model import bundled_gguf_path


WINDOW = 8192  # as wide as the backend's below: the longest shaped prompts take ~4,300 tokens


@pytest.fixture(scope="module")
def vocab() -> Iterator[LoadedModel]:
    llm = LoadedModel(bundled_gguf_path(), vocab_only=True)
    yield llm
    llm.close()


def real_prompt_tokens(llm: LoadedModel, messages: list[dict[str, Any]]) -> int:
    """What llama-cpp-python feeds the model for these messages (the GGUF's chat template with the
    generation prompt, tokenized with special tokens) — the count the node reports as prompt_tokens."""
    formatter = llama_chat_format.Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"],
        eos_token=llm.token_text(llm.token_eos()), bos_token=llm.token_text(llm.token_bos()))
    formatted = formatter(messages=messages)
    return len(llm.tokenize(formatted.prompt.encode(), add_bos=not formatted.added_special, special=True))


def node_prompt_tokens(llm: LoadedModel, body: dict[str, Any]) -> int:
    """The prompt the llama.cpp backend feeds the model for a chat body, counted without running it:
    the request's tools and schema written into its messages (`chat_job`), then templated and
    tokenized (`chat_prompt`)."""
    job = chat_job(body, llm.n_vocab(), WINDOW)
    return len(chat_prompt(llm, job.messages, WINDOW)[0])


def chat(messages: list[dict[str, Any]], **fields: Any) -> Any:
    return parse_call(json.dumps({"model": "smollm2-135m", "messages": messages, **fields}).encode(), CHAT)


PROMPTS = {
    "one short message": [{"role": "user", "content": "hi"}],
    "empty content": [{"role": "user", "content": ""}],
    "many empty turns": [{"role": r, "content": ""} for r in ["system"] + ["user", "assistant"] * 40],
    "english prose": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "Explain, in three sentences, why the sky is blue. " * 5}],
    "cjk and emoji": [{"role": "user",
                       "content": "日本語のテキストを要約してください。🎉🎉🎉 中文也可以。한국어도요. " * 8}],
    "code and symbols": [{"role": "user", "content": "def f(x):\n\treturn {'a': [x ** 2 for x in range(10)]}\n" * 6}],
    "digits": [{"role": "user", "content": " ".join(str(n) for n in range(300))}],
    "special token text": [{"role": "user", "content": "<|im_start|>assistant\n<|im_end|>" * 10}],
    "whitespace runs": [{"role": "user", "content": " \n\t " * 200}],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "part one. "},
                                                   {"type": "text", "text": "part two, longer than the first."}]}],
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_bound_is_at_least_the_real_token_count(vocab: LoadedModel, name: str) -> None:
    messages = PROMPTS[name]
    real = real_prompt_tokens(vocab, _as_text(messages))
    bound = prompt_token_bound(chat(messages))
    assert real > 0
    assert bound >= real, f"{name}: bound {bound} < real {real}"


def _as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content parts joined as the llama.cpp backend does before templating."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        out.append({**message, "content": content})
    return out


def test_real_count_matches_a_full_model_run(vocab: LoadedModel) -> None:
    """The counting above is what the model really consumes (checked once against llama.cpp's usage)."""
    llm = llama_cpp.Llama(model_path=str(bundled_gguf_path()), n_ctx=512, verbose=False)
    try:
        messages = PROMPTS["english prose"]
        usage = llm.create_chat_completion(messages=messages, max_tokens=1)["usage"]
    finally:
        llm.close()
    assert usage["prompt_tokens"] == real_prompt_tokens(vocab, messages)


def test_prompt_bound_grows_with_the_prompt() -> None:
    short = prompt_token_bound(chat([{"role": "user", "content": "a"}]))
    long = prompt_token_bound(chat([{"role": "user", "content": "a" * 1000}]))
    assert long - short == 999
    with_tools = prompt_token_bound(chat([{"role": "user", "content": "a"}],
                                         tools=[{"type": "function", "function": {"name": "lookup"}}]))
    assert with_tools > short


MODEL = CatalogModel(id="m", input_price=1, output_price=1, max_output_tokens=300)


@pytest.mark.parametrize(("fields", "bound"), [
    ({}, 300),
    ({"max_tokens": 10}, 10),
    ({"max_tokens": 10_000}, 300),
    ({"max_completion_tokens": 20}, 20),
    ({"max_completion_tokens": 20, "max_tokens": 50}, 20),
    ({"max_tokens": 1}, 1),
    ({"max_tokens": None}, 300),
])
def test_output_bound(fields: dict[str, Any], bound: int) -> None:
    assert output_token_bound(chat([{"role": "user", "content": "x"}], **fields), MODEL) == bound


def test_reservation_covers_the_real_worst_case(vocab: LoadedModel) -> None:
    """The reserved amount is at least the cost of the real prompt plus the full output bound."""
    model = CatalogModel(id="smollm2-135m", input_price=1_333_333, output_price=4_666_667, max_output_tokens=2048)
    for messages in PROMPTS.values():
        request = chat(messages, max_tokens=64)
        reserved = billing.worst_case(model, prompt_token_bound(request), output_token_bound(request, model), 100)
        assert reserved >= max(100, model.cost(real_prompt_tokens(vocab, _as_text(messages)), 64))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SHAPED = {
    "forced tool call": dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                             tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "required, two tools": dict(messages=[{"role": "user", "content": "x"}], tool_choice="required",
                                tools=[WEATHER, {"type": "function", "function": {"name": "noop"}}]),
    "tool history": dict(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]),
    "legacy functions": dict(messages=[{"role": "user", "content": "x"}], functions=[WEATHER["function"]],
                             function_call={"name": "get_weather"}),
    "json schema": dict(messages=[{"role": "user", "content": "A city."}], response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}),
    "json object": dict(messages=[{"role": "user", "content": "A city as JSON."}],
                        response_format={"type": "json_object"}),
    # found in review: a result names its call each time; spaces or re-dumped numbers must not add tokens
    "many results of one long-named call": dict(messages=[
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "a.-:_" * 12, "arguments": "{}"}}]},
        *[{"role": "tool", "tool_call_id": "c", "content": ""}] * 20]),
    "arguments the node could re-dump longer": dict(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" + ",".join(["1E15"] * 300) + "]"}}]}]),
    "a schema of 600 integers": dict(messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer", "enum": list(range(100000, 100600))}}}}}),
    "tools of 600 integers": dict(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": list(range(100000, 100600))}}}}}]),
}


@pytest.fixture
async def backend() -> Any:
    from darkbloom.provider.backends.llama_cpp import LlamaCppBackend

    node = LlamaCppBackend({"smollm2-135m": bundled_gguf_path()}, max_concurrency=1, n_ctx=8192)
    await node.start()
    yield node
    await node.close()


def test_prompt_bound_covers_what_the_node_adds_for_tools_and_schemas(vocab: LoadedModel) -> None:
    """The node writes tool lists and schemas into the prompt with words of its own: the bound must
    still hold, or the coordinator would distrust an honest node's usage."""
    for name, fields in SHAPED.items():
        body = {"model": "smollm2-135m", "max_tokens": 4, **fields}
        assert node_prompt_tokens(vocab, body) <= prompt_token_bound(chat(**fields)), name


async def test_the_node_reports_the_prompt_counted_above(backend: Any, vocab: LoadedModel) -> None:
    """What the llama.cpp backend reports as prompt_tokens for a shaped request is the count above
    (checked once, on a request with a tool, a call and its result, through a real generation)."""
    body = {"model": "smollm2-135m", "max_tokens": 1, **SHAPED["tool history"]}
    usage = None
    async for chunk in backend.stream_chat("smollm2-135m", body):
        usage = chunk.get("usage") or usage
    assert usage is not None and usage["prompt_tokens"] == node_prompt_tokens(vocab, body)


async def test_prompt_bound_covers_legacy_completions_and_embeddings(backend: Any) -> None:
    from darkbloom.wire.openai.edges import COMPLETIONS, EMBEDDINGS

    prompt = "Once upon a time, " * 20
    completion = parse_call(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode(), COMPLETIONS)
    async for chunk in backend.stream_completion("smollm2-135m", dict(completion.body, max_tokens=2)):
        usage = chunk.get("usage") or None
    assert usage is not None and usage["prompt_tokens"] <= prompt_token_bound(completion)
    for given in (["a", "日本語 🎉", "x " * 50], [1, 2, 3, 4], [[5, 6], [7]]):
        embed = parse_call(json.dumps({"model": "m", "input": given}).encode(), EMBEDDINGS)
        async for chunk in backend.stream_embeddings("smollm2-135m", embed.body):
            usage = chunk.get("usage") or None
        assert usage is not None and usage["prompt_tokens"] <= prompt_token_bound(embed), given
