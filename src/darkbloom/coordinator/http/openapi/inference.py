"""The OpenAPI entries of the inference APIs beyond chat completions — the Responses API, Anthropic
Messages, legacy completions, embeddings: their request bodies, answers and error codes. Every one of
them takes the chat route's policy headers, admission, errors and sealing (``inference.calls``)."""

from __future__ import annotations

from darkbloom.coordinator.http.openapi.operations import CHAT_ERRORS, ROUTED, Answer, Operation
from darkbloom.coordinator.http.openapi.schemas import (COST_MICRO_USD, INTEGER, NULLABLE_STRING, STRING, TIMESTAMP,
                                                        Schema, obj, ref, request_bodies)
from darkbloom.coordinator.http.sealed_body import SEALED_CONTENT_TYPE
from darkbloom.wire.openai.anthropic_request import MESSAGE_PROMPT, MESSAGE_REQUEST
from darkbloom.wire.openai.legacy import COMPLETION_REQUEST, EMBEDDING_REQUEST
from darkbloom.wire.openai.responses.request import RESPONSE_REQUEST

_OPEN = {"type": "object", "additionalProperties": True}
# the API's own usage object, with what the request cost
_USAGE = {**obj({"cost_micro_usd": COST_MICRO_USD}), "additionalProperties": True}


def _event(data: Schema, description: str) -> Schema:
    return {"type": "object", "required": ["data"], "description": description,
            "properties": {"event": STRING, "id": STRING, "retry": INTEGER,
                           "data": {"anyOf": [{"const": "[DONE]"}, {
                               "type": "string", "contentMediaType": "application/json",
                               "contentSchema": {"anyOf": [data, ref("Error"), ref("AnthropicError"),
                                                           ref("SealedResponse")]}}]}}}


INFERENCE_SCHEMAS: dict[str, Schema] = {
    **request_bodies(RESPONSE_REQUEST, MESSAGE_REQUEST, MESSAGE_PROMPT, COMPLETION_REQUEST, EMBEDDING_REQUEST),
    "Response": {**obj({"id": STRING, "object": {"const": "response"}, "created_at": TIMESTAMP, "model": STRING,
                        "status": STRING, "output": {"type": "array", "items": _OPEN}, "usage": _USAGE},
                       ("id", "object", "model", "output")), "additionalProperties": True},
    "ResponseEvent": _event({**obj({"type": STRING}), "additionalProperties": True},
                            "`event: <type>` and `data: {…}` lines, `response.created` … `response.completed` (its "
                            "`response.usage` has `cost_micro_usd`); "
                            "a failure after the first output ends with `error` and `response.failed`."),
    "Message": {**obj({"id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
                       "model": STRING, "content": {"type": "array", "items": _OPEN}, "stop_reason": NULLABLE_STRING,
                       "usage": _USAGE}, ("id", "type", "role", "content")), "additionalProperties": True},
    "MessageEvent": _event({**obj({"type": STRING}), "additionalProperties": True},
                           "Anthropic's events: `message_start`, `content_block_*`, `message_delta` (its `usage` "
                           "has `cost_micro_usd`), "
                           "`message_stop`; `error` after a failure."),
    "MessageTokensCount": obj({"input_tokens": {"type": "integer", "minimum": 0}}, ("input_tokens",),
                              description="The coordinator's estimate of the prompt's tokens (the one its "
                                          "context check uses), not an exact tokenizer count."),
    "AnthropicError": obj({"type": {"const": "error"}, "error": obj({"type": STRING, "message": STRING})},
                          description="The error envelope of /v1/messages and every path under it."),
    "Completion": {**obj({"id": STRING, "object": {"const": "text_completion"}, "created": TIMESTAMP,
                          "model": STRING, "choices": {"type": "array", "items": _OPEN}, "usage": ref("Usage")},
                         ("id", "object", "model", "choices")), "additionalProperties": True},
    "CompletionEvent": _event({**obj({"object": {"const": "text_completion"}}), "additionalProperties": True},
                              "A `data:` line per `text_completion` chunk, the usage chunk only with "
                              "`stream_options.include_usage`, then `data: [DONE]`."),
    "EmbeddingList": {**obj({"object": {"const": "list"}, "data": {"type": "array", "items": _OPEN},
                             "model": STRING, "usage": _USAGE}), "additionalProperties": True},
}


def _operation(summary: str, request: str, answer: str, event: str | None, description: str,
               error_schema: str = "Error") -> Operation:
    content = {"application/json": answer, SEALED_CONTENT_TYPE: "SealedResponse"}
    if event:
        content["text/event-stream"] = event
    return Operation("inference", summary, auth="caller",
                     body={"application/json": request, SEALED_CONTENT_TYPE: "SealedRequest"},
                     route_headers=("X-Darkbloom-Route", "X-Darkbloom-Machine", "X-Darkbloom-Share"), errors=CHAT_ERRORS,
                     answers={200: Answer("The answer, or its server-sent events when streamed; sealed back "
                                          "when the request was sealed.", content, ROUTED)},
                     description=description, error_schema=error_schema)


INFERENCE_OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/responses"): _operation(
        "Create a response (OpenAI Responses API)", "ResponseRequest", "Response", "ResponseEvent",
        "Stateless Responses: translated to a chat completion at the edge, then routed, sealed and billed "
        "like one."),
    ("post", "/v1/messages"): _operation(
        "Create a message (Anthropic Messages)", "MessageRequest", "Message", "MessageEvent",
        "Anthropic Messages, its events and its error envelope; the key may come as `x-api-key`.",
        error_schema="AnthropicError"),
    ("post", "/v1/messages/count_tokens"): Operation(
        "inference", "Count a message's input tokens (Anthropic Messages)", auth="caller",
        body={"application/json": "MessagePrompt"}, route_headers=("X-Darkbloom-Route",),
        errors={400: ("invalid_request_error",), 403: ("model_not_allowed",), 404: ("model_not_found",),
                429: ("rate_limit_exceeded",), 503: ("service_unavailable",)},
        answers={200: Answer("`{\"input_tokens\": N}`: the coordinator's estimate.",
                             {"application/json": "MessageTokensCount"})},
        description="The input tokens of a Messages request (`max_tokens` not needed), as the coordinator "
                    "estimates them for its context check — no node is asked. Not billed, no usage row; "
                    "one request against the caller's RPM limits, taken before the body is read. The key "
                    "may come as `x-api-key`; errors are in Anthropic's envelope.",
        error_schema="AnthropicError"),
    ("post", "/v1/completions"): _operation(
        "Create a completion (legacy)", "CompletionRequest", "Completion", "CompletionEvent",
        "Legacy prompt completions, served by nodes that advertise `completions`."),
    ("post", "/v1/embeddings"): _operation(
        "Create embeddings", "EmbeddingRequest", "EmbeddingList", None,
        "Embeddings, served by nodes that advertise `embeddings`; `encoding_format: base64` gives "
        "little-endian float32."),
}
