"""One inference request, whatever public API it came in on: the body a node receives, what it
needs from the node, and the presenter that answers in the caller's API.

Every API is a translation at the edge (`wire/openai`): the Responses API and Anthropic Messages
become chat completions, legacy completions and embeddings go to the node as what they are. From
here on a request is an `InferenceCall`, and admission, Self-Route, scheduling, sealing, relay and
billing are the same for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from darkbloom.coordinator.inference.chat_validation import chat_needs, validate_chat_body
from darkbloom.wire import json_codec
from darkbloom.wire.openai.body import parse_json_object
from darkbloom.wire.openai.edges import Edge
from darkbloom.wire.openai.errors import invalid_request
from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.protocol import Api
from darkbloom.wire.schema_bounds import repetition_problem


@dataclass(frozen=True)
class InferenceCall:
    edge: Edge
    request: dict[str, Any]  # the caller's own body
    body: dict[str, Any]     # what the node receives, before its model id, `stream` and `max_tokens`
    model: str
    stream: bool
    needs: frozenset[str]    # capabilities beyond plain chat (wire.protocol.CAPABILITIES)
    max_tokens: int | None   # the output bound the caller asked for, if any (each choice's)
    choices: int = 1         # the answer's choices: a legacy completions batch has one per prompt

    @property
    def api(self) -> Api:
        return self.edge.api

    def present(self, request_id: str) -> Presenter:
        return self.edge.presenter(request_id, self.model, self.request)

    def for_provider(self, provider_model_id: str, max_tokens: int) -> bytes:
        """The body the provider receives: its own model id, always streamed, output bounded by
        what admission reserved for (``max_tokens``, shared evenly by the choices)."""
        if self.api == "embeddings":
            forwarded = dict(self.body, model=provider_model_id)
        else:
            forwarded = dict(self.body, model=provider_model_id, stream=True, max_tokens=max_tokens // self.choices)
            forwarded.pop("stream_options", None)
            forwarded.pop("max_completion_tokens", None)
        return json_codec.dumps(forwarded)


def parse_call(raw: bytes, edge: Edge) -> InferenceCall:
    request = parse_json_object(raw)
    model = request.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid_request("you must provide a model parameter", param="model")
    stream = request.get("stream", False) if edge.streams else False
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be a boolean.", param="stream")
    body = edge.to_node(request)
    check_schema_bounds(edge, request)
    choices = 1
    if edge.api == "chat":
        validate_chat_body(body)
        needs = chat_needs(body)
    elif edge.api == "completions":
        choices = len(completion_prompts(body))
        batch = frozenset({"completion_batches"}) if choices > 1 else frozenset()
        needs = frozenset({"completions"}) | batch | _completion_logprobs(body)
    else:
        needs = frozenset({"embeddings"})
    max_tokens = None
    if edge.api != "embeddings":
        for field in ("max_completion_tokens", "max_tokens"):
            if isinstance(body.get(field), int) and not isinstance(body[field], bool):
                max_tokens = body[field]
                break
    return InferenceCall(edge=edge, request=request, body=body, model=model.strip(), stream=stream, needs=needs,
                         max_tokens=max_tokens, choices=choices)


def _completion_logprobs(body: dict[str, Any]) -> frozenset[str]:
    wanted = body.get("logprobs")
    return frozenset({"logprobs"}) if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0 \
        else frozenset()


def check_schema_bounds(edge: Edge, request: dict[str, Any]) -> None:
    """400 naming the bound, in the caller's own body, of a schema no grammar could hold (a node
    would refuse it, or crash on it)."""
    for where in edge.schemas:
        for schema, path in _found(request, where.split("."), ""):
            problem = repetition_problem(schema, path)
            if problem is not None:
                param, message = problem
                raise invalid_request(f"The JSON schema cannot be followed: {message}.", param=param)


def _found(value: Any, steps: list[str], path: str) -> Iterator[tuple[Any, str]]:
    """The values at a dotted path (``tools[*].function.parameters``), each with its own path."""
    if not steps:
        yield value, path
        return
    name, each = steps[0].removesuffix("[*]"), steps[0].endswith("[*]")
    child = value.get(name) if isinstance(value, dict) else None
    if child is None:
        return
    where = f"{path}.{name}" if path else name
    if not each:
        yield from _found(child, steps[1:], where)
    elif isinstance(child, list):
        for index, item in enumerate(child):
            yield from _found(item, steps[1:], f"{where}[{index}]")
