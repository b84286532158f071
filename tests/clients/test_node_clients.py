"""openai-node and the Vercel AI SDK, each driven by one `node` process (tests/clients/node/*.mjs) that
runs every case and prints the outcomes; the assertions on them are here. The packages come from
tests/clients/node/package-lock.json (`make node-clients` runs `npm ci`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest

from tests.clients.support import COLOUR_SCHEMA, MODEL, NODE_DIR, WEATHER_SCHEMA, Stack, cell, errors, valid

pytestmark = pytest.mark.e2e

Results = dict[str, dict[str, dict[str, Any]]]


def _start(script: str, config: dict[str, Any]) -> subprocess.Popen[str]:
    node = shutil.which("node")
    assert node, "node is missing: tests/clients needs Node.js 18 or later (make node-clients)"
    assert (NODE_DIR / "node_modules" / ".package-lock.json").exists(), \
        "tests/clients/node/node_modules is missing: run `make node-clients` (npm ci from the lockfile)"
    return subprocess.Popen([node, script, json.dumps(config)], cwd=NODE_DIR, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(script: str, process: subprocess.Popen[str]) -> dict[str, dict[str, Any]]:
    try:
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, f"{script} exited {process.returncode}: {err[-2000:]}"
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def results(stack: Stack) -> Results:
    """Both scripts at once (the node serves two requests at a time)."""
    config = {"base_url": stack.api_url, "key": stack.key, "model": MODEL, "bad_key": stack.bad_key,
              "broke_key": stack.broke.api_key, "colour_schema": COLOUR_SCHEMA, "weather_schema": WEATHER_SCHEMA}
    scripts = {"openai-node": "openai_node.mjs", "ai-sdk": "ai_sdk.mjs"}
    running = {client: _start(script, {**config, "limited_key": stack.limited_key()})
               for client, script in scripts.items()}
    return {client: _finish(scripts[client], process) for client, process in running.items()}


def ok(results: Results, client: str, case: str) -> Any:
    outcome = results[client][case]
    assert outcome["ok"], f"{case}: {outcome['error']}"
    return outcome["value"]


def failed(results: Results, client: str, case: str) -> dict[str, Any]:
    """The error a case expected (the script reports a request that succeeded as a failed case)."""
    return dict(ok(results, client, case))


# openai-node ------------------------------------------------------------------------------------

@cell("openai-node", "chat")
def test_openai_node_chat(results: Results) -> None:
    value = ok(results, "openai-node", "chat")
    assert value["object"] == "chat.completion" and value["model"] == MODEL
    assert isinstance(value["content"], str) and value["finish_reason"] in ("stop", "length")
    assert value["usage"]["completion_tokens"] > 0


@cell("openai-node", "stream")
def test_openai_node_stream_classic_loop(results: Results) -> None:
    value = ok(results, "openai-node", "stream")
    assert value["chunks"] > 0 and value["usage"] is None


@cell("openai-node", "usage")
def test_openai_node_include_usage(results: Results) -> None:
    value = ok(results, "openai-node", "usage")
    assert value["last_choices"] == 0 and value["usage_chunks"] == 1
    assert value["usage"]["completion_tokens"] > 0


@cell("openai-node", "structured")
@pytest.mark.parametrize("case", ["structured", "structured-responses"])
def test_openai_node_parse(results: Results, case: str) -> None:
    valid(ok(results, "openai-node", case)["parsed"], COLOUR_SCHEMA)


@cell("openai-node", "tool")
def test_openai_node_forced_tool_call(results: Results) -> None:
    value = ok(results, "openai-node", "tool")
    assert value["finish_reason"] == "tool_calls" and value["name"] == "get_weather"
    assert valid(value["arguments"], WEATHER_SCHEMA) == value["parsed_arguments"]
    streamed = ok(results, "openai-node", "tool-stream")
    assert streamed["name"] == "get_weather"
    valid(streamed["arguments"], WEATHER_SCHEMA)


@cell("openai-node", "responses")
def test_openai_node_responses(results: Results) -> None:
    value = ok(results, "openai-node", "responses")
    assert value["object"] == "response" and value["status"] in ("completed", "incomplete")
    assert value["types"] == ["message"] and isinstance(value["output_text"], str)
    assert value["usage"]["output_tokens"] > 0


@cell("openai-node", "responses-stream")
def test_openai_node_responses_stream(results: Results) -> None:
    value = ok(results, "openai-node", "responses-stream")
    assert value["types"][0] == "response.created"
    assert value["types"][-1] in ("response.completed", "response.incomplete")
    assert value["delta"] == value["output_text"] and value["status"] in ("completed", "incomplete")


@cell("openai-node", "responses-tool")
def test_openai_node_responses_tool(results: Results) -> None:
    value = ok(results, "openai-node", "responses-tool")
    assert "function_call" in value["types"] and value["name"] == "get_weather" and value["call_id"]
    valid(value["arguments"], WEATHER_SCHEMA)


@cell("openai-node", "completions")
def test_openai_node_completions(results: Results) -> None:
    value = ok(results, "openai-node", "completions")
    assert value["object"] == "text_completion" and isinstance(value["text"], str)
    assert value["usage"]["completion_tokens"] > 0 and isinstance(value["streamed"], str)


@cell("openai-node", "embeddings")
def test_openai_node_embeddings(results: Results) -> None:
    value = ok(results, "openai-node", "embeddings")
    vectors = value["default"]  # asked as base64, decoded by the SDK
    assert len(vectors) == 2 and all(isinstance(x, (int, float)) for x in vectors[0])
    assert len(vectors[0]) == len(vectors[1]) == len(value["float"]) > 0
    assert vectors[0] == pytest.approx(value["float"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("status, name, code", errors("openai-node", [
    ("401", "AuthenticationError", "invalid_api_key"), ("404", "NotFoundError", "model_not_found"),
    ("402", "APIError", "insufficient_quota"), ("429", "RateLimitError", "rate_limit_exceeded")]))
def test_openai_node_errors(results: Results, status: str, name: str, code: str) -> None:
    error = failed(results, "openai-node", status)
    assert error["status"] == int(status) and error["isAPIError"] and error["isExpectedClass"], error
    if name != "APIError":
        assert error["name"] == name, error
    assert error["code"] == code, error


# the Vercel AI SDK ---------------------------------------------------------------------------

@cell("ai-sdk", "chat")
def test_ai_sdk_chat(results: Results) -> None:
    value = ok(results, "ai-sdk", "chat")
    assert isinstance(value["text"], str) and value["usage"]["outputTokens"] > 0


@cell("ai-sdk", "stream", "usage")
def test_ai_sdk_stream(results: Results) -> None:
    value = ok(results, "ai-sdk", "stream")
    assert "text-delta" in value["types"] and value["usage"]["outputTokens"] > 0


@cell("ai-sdk", "structured")
@pytest.mark.parametrize("case", ["structured", "structured-responses"])
def test_ai_sdk_generate_object(results: Results, case: str) -> None:
    valid(ok(results, "ai-sdk", case)["object"], COLOUR_SCHEMA)


@cell("ai-sdk", "tool")
def test_ai_sdk_tool_call(results: Results) -> None:
    _tool_call(ok(results, "ai-sdk", "tool"))


@cell("ai-sdk", "responses-tool")
def test_ai_sdk_responses_tool_call(results: Results) -> None:
    _tool_call(ok(results, "ai-sdk", "responses-tool"))


def _tool_call(value: dict[str, Any]) -> None:
    assert value["finishReason"] == "tool-calls" and len(value["toolCalls"]) >= 1, value
    assert value["toolCalls"][0]["toolName"] == "get_weather"
    valid(value["toolCalls"][0]["input"], WEATHER_SCHEMA)


@cell("ai-sdk", "responses")
def test_ai_sdk_responses(results: Results) -> None:
    value = ok(results, "ai-sdk", "responses")
    assert isinstance(value["text"], str) and value["usage"]["outputTokens"] > 0


@cell("ai-sdk", "responses-stream")
def test_ai_sdk_responses_stream(results: Results) -> None:
    value = ok(results, "ai-sdk", "responses-stream")
    assert "text-delta" in value["types"] and value["usage"]["outputTokens"] > 0


@cell("ai-sdk", "completions")
def test_ai_sdk_completions(results: Results) -> None:
    value = ok(results, "ai-sdk", "completions")
    assert isinstance(value["text"], str) and isinstance(value["streamed"], str)
    assert value["usage"]["outputTokens"] > 0


@cell("ai-sdk", "embeddings")
def test_ai_sdk_embed(results: Results) -> None:
    value = ok(results, "ai-sdk", "embeddings")
    assert len(value["embedding"]) > 0 and all(isinstance(x, (int, float)) for x in value["embedding"])


@pytest.mark.parametrize("status", errors("ai-sdk", ["401", "404", "402", "429"]))
def test_ai_sdk_errors(results: Results, status: str) -> None:
    error = failed(results, "ai-sdk", status)
    assert error["isAPICallError"] and error["status"] == int(status), error
    assert error["retryable"] is (status == "429"), error
