"""A sealed answer is the plain answer sealed to the client: the same status and headers, the body
opened by the client's key alone, and what was to run once the answer had gone (the request's log
line) still runs."""

from __future__ import annotations

import json

from nacl.public import Box, PrivateKey
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse

from darkbloom.coordinator.http.sealed_body import SEALED_CONTENT_TYPE, Unsealed
from darkbloom.wire.crypto import b64d


def test_a_sealed_json_answer_keeps_its_status_headers_and_what_follows_it() -> None:
    client, coordinator = PrivateKey.generate(), PrivateKey.generate()
    after = BackgroundTask(print)
    plain = JSONResponse({"id": "chatcmpl-1"}, status_code=201, headers={"X-Request-Id": "chatcmpl-1"},
                         background=after)
    sealed = Unsealed(b"{}", Box(coordinator, client.public_key)).seal_response(plain)
    assert sealed.background is after
    assert sealed.status_code == 201 and sealed.headers["x-request-id"] == "chatcmpl-1"
    assert sealed.headers["content-type"] == SEALED_CONTENT_TYPE
    ciphertext = b64d(json.loads(sealed.body)["ciphertext"])
    assert json.loads(Box(client, coordinator.public_key).decrypt(ciphertext)) == {"id": "chatcmpl-1"}
