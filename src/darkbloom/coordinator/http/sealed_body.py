"""Optional consumer → coordinator sealing (docs/api.md "Sealed bodies").

A client fetches ``GET /v1/encryption-key`` and posts ``Content-Type: application/darkbloom-sealed+json``
with ``{kid, ephemeral_public_key, ciphertext}``: a NaCl box from its ephemeral key to the
coordinator's key. The response — each SSE ``data:`` event when streaming — is sealed back to that
ephemeral key as ``{"ciphertext": …}`` (the client opens it with its ephemeral private key and the
coordinator's public key). Errors before any answer stay plain OpenAI envelopes. ``[DONE]`` is the
stream's plain terminator. The key pair: ``coordinator/consumer_key.py``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from nacl.exceptions import CryptoError
from nacl.public import Box

from darkbloom.coordinator.consumer_key import CoordinatorKey
from darkbloom.wire.crypto import DecryptionError, b64d, b64e, public_key_from_b64
from darkbloom.wire.openai.errors import ApiError

SEALED_CONTENT_TYPE = "application/darkbloom-sealed+json"


class Unsealed:
    """The opened request body and the box that seals the answer back to the client."""

    def __init__(self, plaintext: bytes, box: Box) -> None:
        self.plaintext = plaintext
        self._box = box

    def seal(self, data: bytes) -> dict[str, str]:
        return {"ciphertext": b64e(bytes(self._box.encrypt(data)))}

    def seal_response(self, response: JSONResponse | StreamingResponse) -> JSONResponse | StreamingResponse:
        if isinstance(response, StreamingResponse):
            # sealed in place, so the response keeps its own end-of-request handling
            response.body_iterator = self._sealed_events(response.body_iterator)
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(self.seal(bytes(response.body)), status_code=response.status_code,
                            headers={**headers, "Content-Type": SEALED_CONTENT_TYPE},
                            background=response.background)  # what follows the answer follows it sealed

    async def _sealed_events(self, events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """Every ``data:`` line sealed, whatever else its event holds (an ``event:`` line of the
        Responses and Anthropic streams) and however many events one write carries; ``[DONE]`` stays."""
        async for part in events:
            raw = part if isinstance(part, bytes) else str(part).encode()
            yield b"\n".join(self._sealed_line(line) for line in raw.split(b"\n"))

    def _sealed_line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            return line
        return b"data: " + json.dumps(self.seal(line[5:].strip()), separators=(",", ":")).encode()


def unseal(raw: bytes, key: CoordinatorKey) -> Unsealed:
    try:
        envelope = json.loads(raw)
        kid, ephemeral, ciphertext = envelope["kid"], envelope["ephemeral_public_key"], envelope["ciphertext"]
        if not all(isinstance(v, str) for v in (kid, ephemeral, ciphertext)):
            raise TypeError("fields must be strings")
        client_key = public_key_from_b64(ephemeral)
    except RecursionError:
        raise _invalid_envelope("it nests too deeply") from None
    except (ValueError, KeyError, TypeError, DecryptionError) as exc:
        raise _invalid_envelope(str(exc)) from None
    if kid != key.kid:
        raise ApiError(400, "kid_mismatch", "The body was sealed to another key: fetch GET /v1/encryption-key "
                                            "and seal again.")
    box = Box(key.private, client_key)
    try:
        plaintext = box.decrypt(b64d(ciphertext))
    except (CryptoError, ValueError) as exc:
        raise ApiError(400, "decryption_failed", f"The sealed body does not open with this key ({exc}).") from None
    return Unsealed(plaintext, box)


def _invalid_envelope(reason: str) -> ApiError:
    return ApiError(400, "invalid_sealed_envelope",
                    f"A sealed body must be JSON {{kid, ephemeral_public_key, ciphertext}} ({reason}).")
