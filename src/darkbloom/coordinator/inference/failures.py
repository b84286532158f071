"""How an attempt fails (``Failed``, ``ProviderFailure``, each way it can), and what a consumer is
told when its provider fails: always the coordinator's own sentence, before the answer started (an
HTTP error) or after (the stream's error event). Of a provider's refusal only ``param`` may pass, and
only when it names a path of the caller's own body; and ``code`` when it is one the coordinator knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from darkbloom.coordinator.fleet.session import FRAME_TOO_LARGE
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.protocol import MAX_FRAME_BYTES

# A provider's status says whose fault a failure is; its own text never reaches the consumer.
_REQUEST_FAULT = frozenset({400, 404, 413, 422})
_TOO_LARGE_MESSAGE = ("The request is too large for the provider serving this model once sealed; shorten "
                      "the prompt.")
_REQUEST_FAULT_MESSAGE = ("The model's server refused this request as invalid for it (for example longer than "
                          "its context, or a parameter it does not support). Change the request and retry.")
_PROVIDER_FAULT_MESSAGE = "The provider failed to serve the request. Retry; another provider may serve it."
_CONTEXT_MESSAGE = ("The request does not fit in this model's context window: shorten the prompt or lower "
                    "max_tokens.")
_FRAME_MESSAGE = (f"The provider sent a frame over the protocol's {MAX_FRAME_BYTES // (1024 * 1024)} MiB limit, "
                  "which the coordinator refused: the answer could not be delivered.")
_FAILED_AFTER_START = "The provider failed while answering; the answer is incomplete."
CRASHED_PROVIDERS = "request_crashed_providers"
_CRASHED_MESSAGE = ("This request ended the connections of two providers before any output, so it was not "
                    "tried on another one. Change the request (a very large schema bound, say) before retrying.")
_PATH_STEP = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")
CRASHED_COUNT = Counter("darkbloom_requests_crashed_providers_total",
                        "Requests failed because their attempts took down two provider sessions before any output")


@dataclass(frozen=True)
class Failed:
    """How an attempt failed, as its last event."""

    status: int
    message: str  # always the coordinator's own sentence, never the provider's text
    reason: str  # provider_error | provider_unavailable | provider_timeout | untrusted_chunk | untrusted_usage
    param: str | None = None  # for a request the provider refused: which parameter
    code: str | None = None   # and why, from PROVIDER_ERROR_CODES (or FRAME_TOO_LARGE, the coordinator's own)


class ProviderFailure(Exception):
    """An attempt failed before anything reached the client."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(failure.message)
        self.failure = failure

    @property
    def request_fault(self) -> bool:
        """The provider refused the request itself: no other provider would serve it either."""
        return self.failure.reason == "provider_error" and self.failure.status in _REQUEST_FAULT

    @property
    def crashed_providers(self) -> bool:
        return self.failure.reason == CRASHED_PROVIDERS

    def as_api_error(self, request: dict[str, Any] | None = None) -> ApiError:
        """The answer to the caller whose own body is ``request`` (without it, no ``param`` passes)."""
        failure = self.failure
        if self.request_fault and failure.status == 413:
            return ApiError(413, "request_too_large", _TOO_LARGE_MESSAGE)
        if self.request_fault:
            param = failure.param if failure.param and names_a_field(request or {}, failure.param) else None
            if failure.code == "context_length_exceeded":
                return ApiError(400, "invalid_request_error", _CONTEXT_MESSAGE, code="context_length_exceeded",
                                param=param or "messages")
            return ApiError(400, "invalid_request_error", _REQUEST_FAULT_MESSAGE, param=param)
        if self.crashed_providers:
            return ApiError(502, "provider_error", failure.message, code=CRASHED_PROVIDERS,
                            headers={"x-should-retry": "false"})
        if failure.reason == "provider_timeout":
            return ApiError(504, "provider_timeout", failure.message)
        if failure.code == FRAME_TOO_LARGE:
            return ApiError(502, "provider_error", _FRAME_MESSAGE, code=FRAME_TOO_LARGE)
        if failure.reason == "provider_error":
            return ApiError(502, "provider_error", _PROVIDER_FAULT_MESSAGE)
        return ApiError(502, failure.reason, failure.message)


def provider_error(status: int, param: str | None, code: str | None) -> Failed:
    """The provider failed the request (what it said is never kept: it never reaches a consumer)."""
    return Failed(status, "The provider failed to serve the request.", "provider_error", param, code)


PROVIDER_GONE = Failed(502, "The provider disconnected before finishing the request.", "provider_unavailable")
UNTRUSTED_CHUNK = Failed(502, "The provider sent a response chunk that does not open (it failed decryption or is "
                              "not a valid chunk).", "untrusted_chunk")
UNTRUSTED_USAGE = Failed(502, "The provider reported impossible token usage for this request.", "untrusted_usage")


def incomplete(why: str) -> Failed:
    """An attempt that missed a deadline after its first content."""
    return Failed(504, f"The provider {why}; the answer is incomplete.", "provider_timeout")


def timed_out(budget: float) -> ProviderFailure:
    """The failure of an attempt that produced nothing within the first-content budget."""
    return ProviderFailure(Failed(504, f"The provider produced no output within {budget:g} s.", "provider_timeout"))


def crashed_providers() -> ProviderFailure:
    """The failure of a request whose attempts took down two provider sessions before any output
    (counted in ``darkbloom_requests_crashed_providers_total``)."""
    CRASHED_COUNT.inc()
    return ProviderFailure(Failed(502, _CRASHED_MESSAGE, CRASHED_PROVIDERS))


def failure_error(failure: Failed) -> ApiError:
    """What a client is told in-band when the provider fails after the stream started."""
    if failure.code == FRAME_TOO_LARGE:
        return ApiError(502, "provider_error", _FRAME_MESSAGE, code=FRAME_TOO_LARGE)
    message = _FAILED_AFTER_START if failure.reason == "provider_error" else failure.message
    return ApiError(502, "provider_error", message, code=failure.reason)


def names_a_field(body: Any, path: str) -> bool:
    """Whether ``path`` (``messages[0].content``, ``tools[2].function.parameters``) leads to a value
    in ``body``, step by step."""
    steps = list(_PATH_STEP.finditer(path))
    if not steps or "".join(step.group(0) for step in steps) != path:
        return False
    value = body
    for position, step in enumerate(steps):
        key, index = step.group(1), step.group(2)
        if key is not None and step.group(0).startswith(".") == (position == 0):
            return False  # a key is dotted after the first step, and only then
        if key is not None and isinstance(value, dict) and key in value:
            value = value[key]
        elif index is not None and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return False
    return True
