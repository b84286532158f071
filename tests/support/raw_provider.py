"""A hand-driven provider socket for protocol tests: it speaks the real protocol module but lets a
test decide every frame (misbehave, stall, vanish). Never used where a real node can serve."""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from darkbloom.crypto import NodeIdentity, Sealer, open_envelope, public_key_from_b64
from darkbloom.protocol import (
    MAX_FRAME_BYTES,
    InferenceComplete,
    InferenceRequest,
    InferenceResponseChunk,
    ModelInfo,
    Register,
    Usage,
    dump,
    parse_coordinator_frame,
)
from darkbloom.runtime import runtime_hash


class RawProvider:
    def __init__(self, base_url: str, auth_token: str | None = None, models: tuple[str, ...] = ("smollm2-135m",),
                 max_concurrency: int = 1) -> None:
        self.ws_url = base_url.replace("http://", "ws://") + "/ws/provider"
        self.identity = NodeIdentity.generate()
        self.auth_token = auth_token
        self.models = models
        self.max_concurrency = max_concurrency
        self.ws: ClientConnection | None = None
        self.provider_id: str | None = None

    async def connect(self) -> ClientConnection:
        self.ws = await connect(self.ws_url, max_size=2 * MAX_FRAME_BYTES)
        return self.ws

    def register_frame(self) -> Register:
        rh = runtime_hash()
        return Register(auth_token=self.auth_token, models=[ModelInfo(id=m) for m in self.models],
                        backend="raw-test", version="test", runtime_hash=rh,
                        public_key=self.identity.public_key_b64, identity_key=self.identity.identity_key_b64,
                        attestation=self.identity.attestation(rh), max_concurrency=self.max_concurrency)

    async def register(self) -> dict[str, Any]:
        ws = self.ws or await self.connect()
        await ws.send(dump(self.register_frame()))
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "registered":
                self.provider_id = frame["provider_id"]
                return frame

    async def next_request(self) -> tuple[InferenceRequest, dict[str, Any]]:
        assert self.ws is not None
        while True:
            frame = parse_coordinator_frame(await self.ws.recv())
            if isinstance(frame, InferenceRequest):
                body = json.loads(open_envelope(frame.encrypted_body, self.identity.encryption_key))
                return frame, body

    async def answer(self, request: InferenceRequest, text: str) -> None:
        assert self.ws is not None
        sealer = Sealer(public_key_from_b64(request.encrypted_body.ephemeral_public_key))
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
        await self.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                       encrypted_data=sealer.seal(json.dumps(chunk).encode()))))
        await self.ws.send(dump(InferenceComplete(request_id=request.request_id,
                                                  usage=Usage(prompt_tokens=3, completion_tokens=1))))

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
