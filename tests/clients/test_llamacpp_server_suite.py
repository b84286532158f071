"""The cases of llama.cpp's own server tests (github.com/ggml-org/llama.cpp, `tools/server/tests/unit/`:
`test_compat_anthropic.py`, `test_chat_completion.py`, `test_completion.py`) that concern the
OpenAI- and Anthropic-compatible APIs, rewritten here against the real coordinator and node on the
bundled SmolLM2-135M (llama-server's tests use TinyLlama and match its wording with regexes; these
check the same protocol, never the wording). Each test keeps the name of the case it ports.

Left out, and why:
- llama-server's own API: `/completion` (`n_predict`, `timings`, `truncated`, `tokens`,
  `return_tokens`, `stop_type`, `generation_settings`, `response_fields`, `n_probs`, JSON prompts with
  `multimodal_data`), `/tokenize`, `/apply-template`, `/slots`, `/props`, `cache_prompt`,
  `timings_per_token`, the top-level `grammar` and `json_schema` fields, `response_format.schema` on
  `json_object`, `system_fingerprint`, the `__verbose` debug object, chat-template selection
  (`jinja`, `chat_template`, assistant prefill rendering), logit-bias cases built on `/tokenize`.
- Server-process settings: `n_slots`, `kv_unified`, `n_ctx` and `n_batch` variants
  (test_completion_parallel_slots's `/slots` check, test_completion_unified,
  test_consistent_result_different_batch_size, test_nocache_long_input_prompt with a 256 context).
- Exact token counts and regexes on TinyLlama's words (test_chat_completion's `n_prompt`, …).
- Vision (test_anthropic_vision_*): no vision model here; an image goes only to a node that
  advertises `images`, so the coordinator answers 400 `model_capability_unsupported` (kept as
  test_anthropic_vision_format_accepted, where llama-server answers 500).
- Reasoning models (test_anthropic_thinking_with_reasoning_model, a 7B download) and
  test_different_result_different_seed (a 135M model at temperature 1 may repeat itself).
- Where we answer differently on purpose: test_anthropic_empty_messages (llama-server accepts
  `messages: []`; Anthropic and we answer 400), message_start's `input_tokens` (ours is 0, the real
  count comes in `message_delta`: docs/api.md), the first chat chunk's `content` (llama-server sends
  null, we send "" as OpenAI does), and test_invalid_chat_completion_req's two assistant turns in a
  row (a chat template may take them; ours does).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.clients.support import MODEL, Stack, cell

pytestmark = pytest.mark.e2e

CLIENT = "llamacpp-server"
HELLO = [{"role": "user", "content": "Say hello"}]
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
STORY = "I believe the meaning of life is"
WEATHER_TOOL = {"name": "get_weather", "description": "Get the current weather in a location",
                "input_schema": {"type": "object", "properties": {"location": {"type": "string"}},
                                 "required": ["location"]}}
TOOL_TURNS = [{"role": "user", "content": "What's the weather?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "test123", "name": "get_weather",
                                                 "input": {"location": "Paris"}}]}]


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(stack.api_url + path, json=body, headers={"x-api-key": stack.key,
                                                                "Authorization": f"Bearer {stack.key}"}, timeout=120)


def events(stack: Stack, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The JSON of each `data:` line of a stream (not `[DONE]`)."""
    with httpx.stream("POST", stack.api_url + path, json={**body, "stream": True}, timeout=120,
                      headers={"x-api-key": stack.key, "Authorization": f"Bearer {stack.key}"}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def message(stack: Stack, **body: Any) -> dict[str, Any]:
    response = post(stack, "/messages", {"model": MODEL, "max_tokens": 50, "messages": HELLO, **body})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["type"] == "message" and answer["role"] == "assistant" and "timings" not in answer
    return dict(answer)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api_url, api_key=stack.key, max_retries=0)


# test_compat_anthropic.py

@cell(CLIENT, "anthropic")
def test_anthropic_messages_basic(stack: Stack) -> None:
    answer = message(stack)
    assert answer["content"] and answer["content"][0]["type"] == "text" and "text" in answer["content"][0]
    assert answer["stop_reason"] in ("end_turn", "max_tokens")
    usage = answer["usage"]
    assert isinstance(usage["input_tokens"], int) and isinstance(usage["output_tokens"], int)
    assert usage["output_tokens"] > 0


@cell(CLIENT, "anthropic")
@pytest.mark.parametrize("body", [
    {"system": "You are a helpful assistant.", "messages": [{"role": "user", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                               {"type": "text", "text": " the answer?"}]}]},
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
                  {"role": "user", "content": "How are you?"}]},
    {"stop_sequences": ["\n", "END"], "messages": [{"role": "user", "content": "Count to 10"}]},
    {"temperature": 0.5}, {"top_p": 0.9}, {"top_k": 40},
    {"thinking": {"type": "enabled", "budget_tokens": 50}}, {"metadata": {"user_id": "test_user_123"}},
], ids=["with_system", "multipart_content", "conversation", "stop_sequences", "temperature", "top_p", "top_k",
        "thinking", "metadata"])
def test_anthropic_messages_accepted(stack: Stack, body: dict[str, Any]) -> None:
    assert message(stack, **body)["content"] is not None


@cell(CLIENT, "anthropic")
def test_anthropic_messages_streaming(stack: Stack) -> None:
    seen = list(events(stack, "/messages", {"model": MODEL, "max_tokens": 30, "messages": HELLO}))
    kinds = [event["type"] for event in seen]
    for kind in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop"):
        assert kind in kinds, kind
    start = seen[kinds.index("message_start")]["message"]
    assert (start["type"], start["role"], start["content"]) == ("message", "assistant", []) and "usage" in start
    block = seen[kinds.index("content_block_start")]
    assert block["index"] == 0 and block["content_block"]["type"] == "text"
    assert all(e["delta"]["type"] == "text_delta" and "text" in e["delta"] for e in seen
               if e["type"] == "content_block_delta")
    assert seen[kinds.index("content_block_stop")]["index"] == 0
    delta = seen[kinds.index("message_delta")]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] > 0 and delta["usage"]["input_tokens"] > 0  # ours: the real count here
    assert "timings" not in seen[kinds.index("message_stop")]


@cell(CLIENT, "anthropic")
@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "Hello world"}]},
    {"system": "You are a helpful assistant.", "messages": [{"role": "user", "content": "Hello"}]},
], ids=["count_tokens", "count_tokens_with_system"])
def test_anthropic_count_tokens(stack: Stack, body: dict[str, Any]) -> None:
    response = post(stack, "/messages/count_tokens", {"model": MODEL, **body})  # no max_tokens needed
    assert response.status_code == 200, response.text
    assert list(response.json()) == ["input_tokens"] and response.json()["input_tokens"] > 0


@cell(CLIENT, "anthropic")
def test_anthropic_tool_use_basic(stack: Stack) -> None:
    answer = message(stack, max_tokens=200, tools=[WEATHER_TOOL],
                     messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    uses = [block for block in answer["content"] if block["type"] == "tool_use"]
    if uses:
        assert answer["stop_reason"] == "tool_use" and uses[0]["name"] == "get_weather" and uses[0]["id"]
        assert isinstance(uses[0]["input"], dict)


@cell(CLIENT, "anthropic")
@pytest.mark.parametrize("result", [
    [{"type": "tool_result", "tool_use_id": "test123", "content": "The weather is sunny, 25°C"}],
    [{"type": "text", "text": "Here are the results:"},
     {"type": "tool_result", "tool_use_id": "test123", "content": "Sunny, 25°C"}],
    [{"type": "tool_result", "tool_use_id": "test123", "is_error": True, "content": "City not found"}],
], ids=["tool_result", "tool_result_with_text", "tool_result_error"])
def test_anthropic_tool_result(stack: Stack, result: list[dict[str, Any]]) -> None:
    answer = message(stack, max_tokens=100, messages=[*TOOL_TURNS, {"role": "user", "content": result}])
    assert answer["content"] and answer["content"][0]["type"] == "text"


@cell(CLIENT, "anthropic")
def test_anthropic_tool_streaming_and_content_block_indices(stack: Stack) -> None:
    seen = list(events(stack, "/messages", {
        "model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "Calculate 2+2"}],
        "tools": [{"name": "calculator", "description": "Calculate math", "input_schema": {
            "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}],
        "tool_choice": {"type": "any"}}))
    kinds = [event["type"] for event in seen]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e for e in seen if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == list(range(len(starts)))
    assert {e["index"] for e in starts} == {e["index"] for e in seen if e["type"] == "content_block_stop"}
    tools = [e for e in starts if e["content_block"]["type"] == "tool_use"]
    assert tools and tools[0]["content_block"]["name"] == "calculator"


@cell(CLIENT, "anthropic")
def test_anthropic_vision_format_accepted(stack: Stack) -> None:
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
    response = post(stack, "/messages", {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": pixel}},
        {"type": "text", "text": "What is this?"}]}]})
    assert response.status_code == 400  # the format is taken; no node here serves images
    assert response.json()["type"] == "error" and "images" in response.json()["error"]["message"]


@cell(CLIENT, "anthropic")
@pytest.mark.parametrize("body", [{"max_tokens": 50}, {"max_tokens": 50, "messages": []}],
                         ids=["missing_messages", "empty_messages"])
def test_anthropic_refused_messages(stack: Stack, body: dict[str, Any]) -> None:
    response = post(stack, "/messages", {"model": MODEL, **body})
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"


@cell(CLIENT, "anthropic")
def test_anthropic_vs_openai_different_response_format(stack: Stack) -> None:
    chat = post(stack, "/chat/completions", {"model": MODEL, "max_tokens": 50, "messages": HELLO}).json()
    anthropic_ = message(stack)
    assert chat["object"] == "chat.completion" and "choices" in chat and "content" in anthropic_
    assert {"prompt_tokens", "completion_tokens"} <= set(chat["usage"])
    assert {"input_tokens", "output_tokens"} <= set(anthropic_["usage"])


# test_chat_completion.py

@cell(CLIENT, "chat")
@pytest.mark.parametrize("user", ["What is the best book",
                                  [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]],
                         ids=["text", "parts"])
def test_chat_completion(stack: Stack, user: Any) -> None:
    response = post(stack, "/chat/completions", {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": "Book"}, {"role": "user", "content": user}]})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "cmpl" in answer["id"] and answer["model"] == MODEL
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert answer["usage"]["prompt_tokens"] > 0
    assert (choice["finish_reason"], answer["usage"]["completion_tokens"]) == ("length", 8) or \
        (choice["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] <= 8)


@cell(CLIENT, "chat")
def test_chat_completion_stream(stack: Stack) -> None:
    chunks = list(events(stack, "/chat/completions", {"model": MODEL, "max_tokens": 8, "messages": BOOK,
                                                       "stream_options": {"include_usage": True}}))
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] == ""  # llama-server sends null here; OpenAI ""
    assert len({chunk["id"] for chunk in chunks}) == 1 and all(chunk["model"] == MODEL for chunk in chunks)
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in with_choices[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in with_choices if c["choices"][0]["finish_reason"]]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= 8


@cell(CLIENT, "chat")
def test_chat_completion_with_openai_library(stack: Stack) -> None:
    answer = client(stack).chat.completions.create(model=MODEL, messages=BOOK, max_tokens=8, seed=42,  # type: ignore[arg-type]
                                                   temperature=0.8)
    assert answer.choices[0].finish_reason in ("length", "stop") and answer.choices[0].message.content is not None


@cell(CLIENT, "chat")
@pytest.mark.parametrize("response_format, ok", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "foooooo"}}}, True),
    ({"type": "json_object"}, True),
    ({"type": "sound"}, False),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 123}}, False),
], ids=["json_schema_const", "json_object", "unknown_type", "schema_not_an_object"])
def test_completion_with_response_format(stack: Stack, response_format: dict[str, Any], ok: bool) -> None:
    response = post(stack, "/chat/completions", {"model": MODEL, "max_tokens": 10, "response_format": response_format,
                                                 "messages": [{"role": "system", "content": "You are a coding assistant."},
                                                              {"role": "user", "content": "Write an example"}]})
    if not ok:
        assert response.status_code == 400 and "error" in response.json()
        return
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    if "json_schema" in response_format:
        assert json.loads(content) == "foooooo"
    else:
        assert content.lstrip().startswith(("{", "["))


@cell(CLIENT, "chat")
@pytest.mark.parametrize("messages", [None, "string", [123], [{}], [{"role": 123}],
                                      [{"role": "system", "content": 123}], [{"role": "system", "content": "test"}, {}]])
def test_invalid_chat_completion_req(stack: Stack, messages: Any) -> None:
    response = post(stack, "/chat/completions", {"model": MODEL, "messages": messages})
    assert response.status_code == 400 and "error" in response.json()


@cell(CLIENT, "chat")
@pytest.mark.parametrize("stream", [False, True], ids=["logprobs", "logprobs_stream"])
def test_logprobs(stack: Stack, stream: bool) -> None:
    asked = dict(model=MODEL, temperature=0.0, messages=BOOK, max_tokens=5, logprobs=True, top_logprobs=10)
    if not stream:
        answer = client(stack).chat.completions.create(**asked)  # type: ignore[call-overload]
        tokens = answer.choices[0].logprobs.content
        text = answer.choices[0].message.content
    else:
        tokens, parts = [], []
        for index, chunk in enumerate(client(stack).chat.completions.create(**asked, stream=True)):  # type: ignore[call-overload]
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            assert (choice.delta.role == "assistant") == (index == 0)
            parts.append(choice.delta.content or "")
            tokens += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
        text = "".join(parts)
    assert tokens and all(t.logprob <= 0.0 and t.bytes is not None and t.top_logprobs for t in tokens)
    assert "".join(t.token for t in tokens) == text


# test_completion.py (its OpenAI-library cases; the rest is llama-server's own /completion)

@cell(CLIENT, "completions")
@pytest.mark.parametrize("stream", [False, True], ids=["completion_with_openai_library",
                                                       "completion_stream_with_openai_library"])
def test_completion_with_openai_library(stack: Stack, stream: bool) -> None:
    if not stream:
        answer = client(stack).completions.create(model=MODEL, prompt=STORY, max_tokens=8)
        assert answer.choices[0].finish_reason in ("length", "stop") and isinstance(answer.choices[0].text, str)
        return
    text = ""
    for chunk in client(stack).completions.create(model=MODEL, prompt=STORY, max_tokens=8, stream=True):
        if chunk.choices and chunk.choices[0].finish_reason is None:
            assert chunk.choices[0].text is not None
            text += chunk.choices[0].text
    assert text


@cell(CLIENT, "completions")
def test_completion_stream_vs_non_stream(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 8, "temperature": 0}
    whole = post(stack, "/completions", body).json()["choices"][0]["text"]
    assert "".join(chunk["choices"][0]["text"] for chunk in events(stack, "/completions", body)
                   if chunk["choices"]) == whole


@cell(CLIENT, "completions")
def test_consistent_result_same_seed(stack: Stack) -> None:
    texts = {post(stack, "/completions", {"model": MODEL, "prompt": STORY, "seed": 42, "temperature": 0.0})
             .json()["choices"][0]["text"] for _ in range(4)}
    assert len(texts) == 1


@cell(CLIENT, "completions")
def test_completion_with_tokens_input(stack: Stack) -> None:
    tokens = [1, 504, 3549, 260, 3015, 282, 1029, 314]
    single = post(stack, "/completions", {"model": MODEL, "prompt": tokens, "temperature": 0, "max_tokens": 8})
    assert single.status_code == 200 and isinstance(single.json()["choices"][0]["text"], str)
    for batch in ([tokens, tokens], [STORY, STORY]):
        response = post(stack, "/completions", {"model": MODEL, "prompt": batch, "temperature": 0, "max_tokens": 8})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1] and choices[0]["text"] == choices[1]["text"]


@cell(CLIENT, "completions")
def test_completion_parallel_requests(stack: Stack) -> None:
    prompts = ["Write a very long book.", "Write another a poem.", "What is LLM?", "The sky is blue and I love it."]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: post(stack, "/completions", {"model": MODEL, "prompt": p, "seed": 42,
                                                                       "max_tokens": 16}), prompts))
    assert all(a.status_code == 200 and isinstance(a.json()["choices"][0]["text"], str) for a in answers)
