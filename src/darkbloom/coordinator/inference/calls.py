"""One inference request, whatever public API it came in on: the body a node receives, checked, what it
needs from the node, the presenter that answers in the caller's API, and its bounds: in tokens, and
in time once its answer has started.

Every API is a translation at the edge (`wire/openai`): the Responses API and Anthropic Messages
become chat completions, legacy completions and embeddings go to the node as what they are. From
here on a request is an `InferenceCall`, and admission, Self-Route, scheduling, sealing, relay and
billing are the same for all of them.

Its bounds are computed without the model's tokenizer: the prompt's, `wire.token_bounds` of the body
the node receives (the node clamps what it reports to the same bound); the output's from max_tokens
and the catalog; the context it may take from both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.wire import token_bounds
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.body import parse_json_object
from darkbloom.wire.openai.edges import Edge
from darkbloom.wire.openai.errors import invalid_request
from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.protocol import Api
from darkbloom.wire.schema_bounds import repetition_problem

BYTES_PER_TOKEN = 4  # about what English text takes per token with a byte-level BPE vocabulary


@dataclass(frozen=True)
class TokenBounds:
    """The most a request may take: its prompt's proven upper bound and its output bound (what it is
    reserved and rate-charged for, and the most a provider may truthfully report), and the context it
    needs of a session (0: not checked)."""

    prompt: int
    output: int
    context: int


@dataclass(frozen=True)
class Deadlines:
    """After first content: at most ``idle`` seconds between provider events, and the whole request
    over by ``until`` (monotonic). A provider that misses either is stopped and the request fails."""

    idle: float
    until: float

    @classmethod
    def from_settings(cls, settings: CoordinatorSettings, started: float) -> "Deadlines":
        return cls(idle=settings.idle_timeout, until=started + settings.request_timeout)


@dataclass(frozen=True)
class InferenceCall:
    edge: Edge
    api: Api
    request: dict[str, Any]  # the caller's own body
    body: dict[str, Any]     # what the node receives, before its model id, `stream` and `max_tokens`
    model: str
    stream: bool
    needs: frozenset[str]    # capabilities beyond plain chat (wire.protocol.CAPABILITIES)
    max_tokens: int | None   # the output bound the caller asked for, if any (each choice's)
    choices: int = 1         # the answer's choices: a legacy completions batch has one per prompt

    def present(self, request_id: str) -> Presenter:
        return self.edge.presenter(request_id, self.model, self.request)

    def node_body(self, max_tokens: int) -> dict[str, Any]:
        """The body the provider receives, but for its own model id: always streamed, its output
        bounded by what admission reserved for (``max_tokens``, shared evenly by the choices)."""
        if self.api == "embeddings":
            return dict(self.body)
        body = dict(self.body, stream=True, max_tokens=max_tokens // self.choices)
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        return body

    def bounds(self, model: CatalogModel) -> TokenBounds:
        prompt = prompt_token_bound(self)
        output = output_token_bound(self, model)
        return TokenBounds(prompt, output, context_needed(self, prompt, output))


def parse_call(raw: bytes, edge: Edge) -> InferenceCall:
    request = parse_json_object(raw)
    body = edge.to_node(request)  # checked by its API's schema: a 400 naming the parameter
    check_schema_bounds(edge, request)
    stream = bool(request.get("stream")) if edge.streams else False
    choices = 1
    if edge.api == "chat":
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
    return InferenceCall(edge=edge, api=edge.api, request=request, body=body, model=request["model"].strip(), stream=stream,
                         needs=needs, max_tokens=max_tokens, choices=choices)


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


def chat_needs(body: dict[str, Any]) -> frozenset[str]:
    """The capabilities a chat request needs beyond plain text (routing sends it only where they are)."""
    needs = set()
    if (body.get("tools") and body.get("tool_choice") != "none") or \
            (body.get("functions") and body.get("function_call") != "none"):
        needs.add("tools")
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        needs.add("structured_output")
    if body.get("logprobs") is True or body.get("top_logprobs"):
        needs.add("logprobs")
    if _has_images(body["messages"]):
        needs.add("images")
    return frozenset(needs)


def _has_images(messages: list[Any]) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") in ("image_url", "input_image") for part in content):
            return True
    return False


# the bounds

def prompt_token_bound(call: InferenceCall) -> int:
    return token_bounds.prompt_token_bound(call.api, call.body)


def output_token_bound(call: InferenceCall, model: CatalogModel) -> int:
    """The request's output bound: max_completion_tokens / max_tokens, at most the catalog's maximum,
    for each of its choices (embeddings generate nothing)."""
    if call.api == "embeddings":
        return 0
    each = model.max_output_tokens if call.max_tokens is None else min(call.max_tokens, model.max_output_tokens)
    return each * call.choices


def context_needed(call: InferenceCall, prompt_bound: int, output_bound: int) -> int:
    """The context the request may take (docs/models.md "Context length"): its prompt at
    ``BYTES_PER_TOKEN``, plus the max_tokens it asked for (capped as the reservation caps it), or
    plus one token when it asked for none (a node ends the answer where its context ends,
    finish_reason "length"); for a completions batch, its longest prompt and one choice's output.
    0 for embeddings: each input is its own sequence, which the node checks.

    Not the prompt's bound: that counts a token per byte, about four times what ordinary text
    takes, and would turn away prompts a node serves. A prompt this estimate counts low (code,
    digits, other scripts) is refused by the node, which counts exactly."""
    if call.api == "embeddings":
        return 0
    if call.choices > 1:  # a completions batch: each prompt is a sequence of its own
        prompt_bound = max(token_bounds.prompt_token_bound(call.api, dict(call.body, prompt=prompt))
                           for prompt in completion_prompts(call.body))
        output_bound //= call.choices
    return prompt_estimate(prompt_bound) + (output_bound if call.max_tokens is not None else 1)


def prompt_estimate(prompt_bound: int) -> int:
    """The prompt's tokens as the coordinator estimates them (its bound at ``BYTES_PER_TOKEN``): what
    the context check counts, and what ``POST /v1/messages/count_tokens`` answers."""
    return -(-prompt_bound // BYTES_PER_TOKEN)
