"""The optional sealed body (docs/api.md "Sealed bodies"): the client seals its request to GET /v1/encryption-key,
the answer (each SSE event when streaming) comes back sealed to the client's ephemeral key."""

from __future__ import annotations

import json

import httpx
import pytest
from nacl.public import Box, PrivateKey

from darkbloom.wire.crypto import b64d, b64e, public_key_from_b64
from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

SEALED = "application/darkbloom-sealed+json"
BODY = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}


def _key(stack: Stack) -> dict[str, str]:
    response = httpx.get(stack.coordinator.api_url + "/encryption-key")
    assert response.status_code == 200
    key = response.json()
    assert key["algorithm"] == "x25519-nacl-box" and key["kid"]
    return key


def _seal(stack: Stack, body: dict[str, object], kid: str | None = None) -> tuple[dict[str, str], Box]:
    key = _key(stack)
    ephemeral = PrivateKey.generate()
    box = Box(ephemeral, public_key_from_b64(key["public_key"]))
    envelope = {"kid": kid or key["kid"], "ephemeral_public_key": b64e(bytes(ephemeral.public_key)),
                "ciphertext": b64e(bytes(box.encrypt(json.dumps(body).encode())))}
    return envelope, box


def _post(stack: Stack, envelope: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(stack.coordinator.api_url + "/chat/completions", content=json.dumps(envelope),
                      headers={**stack.owner.headers(), "Content-Type": SEALED, **(headers or {})}, timeout=60)


def test_sealed_request_and_sealed_answer(stack: Stack) -> None:
    envelope, box = _seal(stack, BODY)
    response = _post(stack, envelope)
    assert response.status_code == 200, response.text
    assert "choices" not in response.text
    answer = json.loads(box.decrypt(b64d(response.json()["ciphertext"])))
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] > 0


def test_sealed_stream_seals_every_event(stack: Stack) -> None:
    envelope, box = _seal(stack, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    response = _post(stack, envelope, {"X-Darkbloom-Route": "self"})
    assert response.status_code == 200, response.text
    assert response.headers["x-darkbloom-routed"] == "owned"
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(box.decrypt(b64d(json.loads(event)["ciphertext"]))) for event in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip()
    assert chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("path, body", [
    ("/responses", {"model": "smollm2-135m", "input": "Name a colour.", "max_output_tokens": 8, "stream": True}),
    ("/messages", {"model": "smollm2-135m", "max_tokens": 8, "stream": True,
                   "messages": [{"role": "user", "content": "Name a colour."}]}),
])
def test_sealed_event_streams_of_the_other_apis_seal_every_data_line(stack: Stack, path: str,
                                                                     body: dict[str, object]) -> None:
    """The Responses and Anthropic streams carry an `event:` line before each `data:` line: the event
    type stays readable, every payload is sealed (none of the answer's JSON is in the clear)."""
    envelope, box = _seal(stack, body)
    response = httpx.post(stack.coordinator.api_url + path, content=json.dumps(envelope),
                          headers={**stack.owner.headers(), "Content-Type": SEALED}, timeout=60)
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    assert data and len(data) == len(kinds) and all(line.startswith(("data: ", "event: ")) for line in lines)
    events = [json.loads(box.decrypt(b64d(json.loads(item)["ciphertext"]))) for item in data]
    assert [event["type"] for event in events] == kinds
    assert kinds[-1] in ("response.completed", "message_stop")


@pytest.mark.parametrize("envelope", [{"kid": "x"}, ["not", "an", "object"], {"kid": "k", "ephemeral_public_key": "AAAA",
                                                                           "ciphertext": "AAAA"}])
def test_malformed_envelope(stack: Stack, envelope: object) -> None:
    response = _post(stack, envelope)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_sealed_envelope"


def test_kid_mismatch(stack: Stack) -> None:
    envelope, _ = _seal(stack, BODY, kid="kid_someone_else")
    response = _post(stack, envelope)
    assert response.status_code == 400 and response.json()["error"]["code"] == "kid_mismatch"


def test_decryption_failed(stack: Stack) -> None:
    envelope, _ = _seal(stack, BODY)
    stranger = Box(PrivateKey.generate(), PrivateKey.generate().public_key)
    envelope["ciphertext"] = b64e(bytes(stranger.encrypt(b"{}")))
    response = _post(stack, envelope)
    assert response.status_code == 400 and response.json()["error"]["code"] == "decryption_failed"
