"""Counting a Messages request's input tokens without serving it (`POST /v1/messages/count_tokens`,
docs/api.md "Counting tokens").

The count is the coordinator's own estimate of the prompt — the one its context check uses
(``inference.calls.prompt_estimate`` of the translated chat prompt's bound) — not a tokenizer's
exact figure: no node is asked. Nothing is billed or written to the usage history, but the route
takes one request from the caller's RPM buckets before the body is read, as every inference route
does; the model must be one the caller may use (404 / 403 as for the request itself)."""

from __future__ import annotations

from starlette.datastructures import Headers

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.calls import prompt_estimate
from darkbloom.coordinator.routing.route import resolve_model, resolve_policy
from darkbloom.coordinator.services import Services
from darkbloom.wire.openai.anthropic_request import messages_prompt
from darkbloom.wire.openai.body import parse_json_object
from darkbloom.wire.token_bounds import prompt_token_bound


def count_input_tokens(services: Services, caller: Caller, headers: Headers, raw: bytes) -> dict[str, int]:
    """Anthropic's answer, ``{"input_tokens": N}``, for the Messages body ``raw``."""
    prompt = messages_prompt(parse_json_object(raw))
    resolve_model(services, caller, prompt["model"], resolve_policy(headers, caller, with_pin=False))
    return {"input_tokens": prompt_estimate(prompt_token_bound("chat", prompt))}
