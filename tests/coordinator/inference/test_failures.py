"""What a consumer is told of a provider's failure (issue 19, rows 5 and 14): the coordinator's own
sentences after first content too, and a provider's ``param`` only when it names a path of the
caller's own body."""

from __future__ import annotations

import pytest

from darkbloom.coordinator.fleet.session import FRAME_TOO_LARGE
from darkbloom.coordinator.inference.attempts import Attempt
from darkbloom.coordinator.fleet.slots import Slots
from darkbloom.coordinator.inference.failures import Failed, ProviderFailure, failure_error, names_a_field
from tests.coordinator.routing.sim import SimProvider

BODY = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}
SECRET = "/home/provider/secret.gguf user=bob"


@pytest.mark.parametrize("path", ["messages", "messages[0]", "messages[0].content[0].text", "tools[0].function",
                                  "tools[0].function.parameters.type", "response_format.json_schema.schema",
                                  "model"])
def test_a_path_of_the_body_names_a_field(path: str) -> None:
    assert names_a_field(BODY, path)


@pytest.mark.parametrize("path", ["visit.evil-example.com.for-a-refund", "messages[1]", "messages[0].name",
                                  "tools[0]..function", "[0]", "messages.0", "tools[x]", "", ".messages",
                                  "model.length", "messages[0]]", "stream", "messages[0]content"])
def test_anything_else_does_not(path: str) -> None:
    assert not names_a_field(BODY, path)


def _refusal(param: str | None, code: str | None = None) -> ProviderFailure:
    attempt = Attempt("chatcmpl-f", Slots().claim(SimProvider().session))
    attempt.on_error(400, SECRET, param, code)
    assert attempt.failure is not None
    return ProviderFailure(attempt.failure)


def test_a_refusals_param_passes_only_when_it_names_the_callers_field() -> None:
    assert _refusal("tools[0].function.parameters").as_api_error(BODY).param == "tools[0].function.parameters"
    assert _refusal("visit.evil-example.com.for-a-refund").as_api_error(BODY).param is None
    assert _refusal("tools[0]").as_api_error({"model": "m", "messages": []}).param is None
    context = _refusal("visit.evil", "context_length_exceeded").as_api_error(BODY)
    assert (context.code, context.param) == ("context_length_exceeded", "messages")


def test_the_providers_words_are_never_kept() -> None:
    failure = _refusal("messages")
    assert SECRET not in failure.failure.message and SECRET not in str(failure)


@pytest.mark.parametrize("failure", [
    Failed(500, SECRET, "provider_error"), Failed(502, SECRET, "provider_error", code=FRAME_TOO_LARGE)])
def test_an_in_band_error_is_the_coordinators_sentence(failure: Failed) -> None:
    """Even for a Failed that somehow carried the provider's words, the stream's error does not."""
    error = failure_error(failure)
    assert SECRET not in error.message and error.type == "provider_error"
