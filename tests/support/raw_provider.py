"""A hand-driven provider socket for protocol tests: it speaks the real protocol module but lets a
test decide every frame (misbehave, stall, vanish). Never used where a real node can serve.
``ThreadedRaw`` runs one on its own thread, for tests written as plain (sync) code.

Attestation challenges (the first one is part of registration) are answered as ``challenge_answer``
says: ``"valid"`` (default), ``"bad_signature"``, ``"changed_runtime"`` or ``"ignore"``; every
challenge and ``trust_status`` seen is kept in ``challenges`` / ``trust_statuses``."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from darkbloom.wire.crypto import NodeIdentity, Sealer, challenge_message, open_envelope, public_key_from_b64
from darkbloom.wire.protocol import (
    MAX_FRAME_BYTES,
    AttestationChallenge,
    AttestationResponse,
    Cancel,
    ErrorFrame,
    Hardware,
    Heartbeat,
    InferenceComplete,
    InferenceError,
    InferenceRequest,
    InferenceResponseChunk,
    ModelInfo,
    Register,
    TrustStatus,
    Usage,
    dump,
    parse_coordinator_frame,
)
from darkbloom.wire.runtime import runtime_hash


CHALLENGE_ANSWERS = ("valid", "bad_signature", "changed_runtime", "ignore")


class RawProvider:
    def __init__(self, base_url: str, auth_token: str | None = None, models: tuple[str, ...] = ("smollm2-135m",),
                 max_concurrency: int = 1, challenge_answer: str = "valid", tamper_attestation: bool = False,
                 certificate: str | None = None, identity: NodeIdentity | None = None,
                 runtime: str | None = None, max_request_frame_bytes: int | None = None,
                 capabilities: tuple[str, ...] = (), authenticated_chunks: bool = True,
                 loaded: tuple[str, ...] | None = None, model_fields: dict[str, Any] | None = None,
                 private_only: bool = False, hardware: Hardware | None = None) -> None:
        assert challenge_answer in CHALLENGE_ANSWERS, challenge_answer
        self.ws_url = base_url.replace("http://", "ws://") + "/ws/provider"
        self.identity = identity or NodeIdentity.generate()
        self.auth_token = auth_token
        self.models = models
        self.max_concurrency = max_concurrency
        self.challenge_answer = challenge_answer
        self.tamper_attestation = tamper_attestation
        self.certificate = certificate
        self.runtime = runtime or runtime_hash()
        self.max_request_frame_bytes = max_request_frame_bytes  # None: not advertised (an older node)
        self.capabilities = capabilities  # advertised for every model
        self.authenticated_chunks = authenticated_chunks  # False: chunks from fresh keys (an older node)
        # the models in memory (registration and heartbeats); None: not said at registration, every
        # model listed in heartbeats (an older node)
        self.loaded = loaded
        self.model_fields = model_fields or {}  # more ModelInfo fields for every model (weight_hash, …)
        self.private_only = private_only  # registers as `darkbloom serve --private-only`
        self.hardware = hardware or Hardware()  # where it says it runs its models (default: unknown)
        self.ws: ClientConnection | None = None
        self.provider_id: str | None = None
        self.registered: dict[str, Any] | None = None
        self.challenges: list[AttestationChallenge] = []
        self.trust_statuses: list[TrustStatus] = []
        self.seen_requests: set[str] = set()  # ids of every inference_request received

    async def connect(self) -> ClientConnection:
        self.ws = await connect(self.ws_url, max_size=2 * MAX_FRAME_BYTES)
        return self.ws

    def register_frame(self) -> Register:
        rh = self.runtime
        attestation = self.identity.attestation(rh)
        if self.tamper_attestation:
            attestation = _tampered(attestation)
        return Register(auth_token=self.auth_token, models=[ModelInfo(id=m, capabilities=list(self.capabilities),
                                                                           **self.model_fields)
                                                                 for m in self.models],
                        loaded_models=None if self.loaded is None else list(self.loaded),
                        backend="raw-test", version="test", runtime_hash=rh,
                        public_key=self.identity.public_key_b64, identity_key=self.identity.identity_key_b64,
                        attestation=attestation, certificate=self.certificate,
                        max_concurrency=self.max_concurrency, authenticated_chunks=self.authenticated_chunks,
                        private_only=self.private_only, hardware=self.hardware,
                        **({"max_request_frame_bytes": self.max_request_frame_bytes}
                           if self.max_request_frame_bytes else {}))

    async def register(self) -> dict[str, Any]:
        """Send `register`, answer the registration challenge, return the `registered` frame."""
        ws = self.ws or await self.connect()
        await ws.send(dump(self.register_frame()))
        while True:
            frame = await self.recv()
            if isinstance(frame, dict) and frame["type"] == "registered":
                self.provider_id = frame["provider_id"]
                self.registered = frame
                return frame

    async def recv(self) -> Any:
        """The next coordinator frame, parsed (`registered` as a plain dict); challenges are answered
        as ``challenge_answer`` says and `trust_status` frames recorded on the way."""
        assert self.ws is not None
        raw = await self.ws.recv()
        if json.loads(raw).get("type") == "registered":
            return json.loads(raw)
        frame = parse_coordinator_frame(raw)
        if isinstance(frame, AttestationChallenge):
            self.challenges.append(frame)
            if self.challenge_answer != "ignore":
                await self.ws.send(dump(self.challenge_response(frame, self.challenge_answer)))
        elif isinstance(frame, TrustStatus):
            self.trust_statuses.append(frame)
        return frame

    async def recv_until(self, kind: type) -> Any:
        """Receive (answering challenges) until a frame of this protocol class arrives."""
        while True:
            frame = await self.recv()
            if isinstance(frame, kind):
                return frame

    async def round_trip(self) -> list[Any]:
        """A barrier: send a second `register` (a bad frame, answered with an `already_registered`
        error) and read up to that answer. The session's reader handles frames in order and its one
        writer sends them in order, so by then every frame sent before has been handled and every
        frame the coordinator queued before has arrived; those are returned (inference requests are
        also added to ``seen_requests``). Each call costs one of the session's three bad-frame strikes."""
        assert self.ws is not None
        await self.ws.send(dump(self.register_frame()))
        frames: list[Any] = []
        async with asyncio.timeout(30):  # bounds only a failure
            while not isinstance(frame := await self.recv(), ErrorFrame) or frame.code != "already_registered":
                if isinstance(frame, InferenceRequest):
                    self.seen_requests.add(frame.request_id)
                frames.append(frame)
        return frames

    def challenge_response(self, challenge: AttestationChallenge, answer: str = "valid") -> AttestationResponse:
        rh = self.runtime
        if answer == "changed_runtime":
            rh = "sha256:" + "0" * 64
        message = challenge_message(challenge.nonce, challenge.timestamp, rh)
        if answer == "bad_signature":
            message = challenge_message(challenge.nonce, challenge.timestamp + 1, rh)
        return AttestationResponse(nonce=challenge.nonce, signature=self.identity.sign(message), runtime_hash=rh)

    async def next_request(self) -> tuple[InferenceRequest, dict[str, Any]]:
        while True:
            frame = await self.recv()
            if isinstance(frame, InferenceRequest):
                self.seen_requests.add(frame.request_id)
                body = json.loads(open_envelope(frame.encrypted_body, self.identity.encryption_key))
                return frame, body

    def sealer(self, request: InferenceRequest) -> Sealer:
        """What seals this provider's chunks for ``request``: from its own key, as a node does, or (an
        older node) from a fresh key."""
        reply_to = request.encrypted_body.ephemeral_public_key
        if self.authenticated_chunks:
            return Sealer.between(self.identity.encryption_key, reply_to)
        return Sealer(public_key_from_b64(reply_to))

    async def answer(self, request: InferenceRequest, text: str) -> None:
        assert self.ws is not None
        sealer = self.sealer(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
        await self.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                       encrypted_data=sealer.seal(json.dumps(chunk).encode()))))
        await self.ws.send(dump(InferenceComplete(request_id=request.request_id,
                                                  usage=Usage(prompt_tokens=3, completion_tokens=1))))

    async def send_chunk(self, request: InferenceRequest, text: str, finish_reason: str | None = None) -> None:
        """One sealed content chunk, and nothing else (no completion)."""
        assert self.ws is not None
        sealer = self.sealer(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}]}
        await self.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                       encrypted_data=sealer.seal(json.dumps(chunk).encode()))))

    async def send_data(self, request: InferenceRequest, chunk: dict[str, Any] | list[Any]) -> None:
        """One sealed chunk of any shape (a tool-call delta, a legacy completion, embeddings, an array
        of chunks sent together)."""
        assert self.ws is not None
        sealer = self.sealer(request)
        await self.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                       encrypted_data=sealer.seal(json.dumps(chunk).encode()))))

    async def send_complete(self, request: InferenceRequest, prompt_tokens: int, completion_tokens: int) -> None:
        assert self.ws is not None
        await self.ws.send(dump(InferenceComplete(request_id=request.request_id, usage=Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))))

    async def send_error(self, request: InferenceRequest, status: int, message: str, param: str | None = None,
                         code: str | None = None) -> None:
        assert self.ws is not None
        await self.ws.send(dump(InferenceError(request_id=request.request_id, status_code=status, message=message,
                                               param=param, code=code)))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(models=list(self.models if self.loaded is None else self.loaded))

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


class ThreadedRaw:
    """A `RawProvider` run on its own event loop in a background thread: it registers, answers
    challenges (as ``challenge_answer`` says), heartbeats, and records every `inference_request`
    (``requests``: ids in order, ``frames``: by id) and `cancel`; with ``answer`` set it replies to
    each request with that text, otherwise the test answers with ``chunk`` and ``complete``."""

    def __init__(self, base_url: str, auth_token: str | None, *, answer: str | None = None,
                 heartbeat_every: float = 2.0, **options: Any) -> None:
        self.provider = RawProvider(base_url, auth_token, **options)
        self.answer_text = answer
        self.heartbeat_every = heartbeat_every
        self.requests: list[str] = []
        self.frames: dict[str, InferenceRequest] = {}
        self.cancels: list[str] = []
        self.registered: dict[str, Any] | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("raw provider did not register in 30 s")
        if self._error is not None:
            raise AssertionError(f"raw provider failed: {self._error!r}")

    @property
    def session_id(self) -> str:
        assert self.provider.provider_id is not None
        return self.provider.provider_id

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._main())
        try:
            self._loop.run_until_complete(self._task)
        except BaseException:  # noqa: BLE001 - cancelled at close
            pass

    async def _main(self) -> None:
        try:
            self.registered = await self.provider.register()
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        beats = asyncio.ensure_future(self._heartbeats())
        try:
            while True:
                frame = await self.provider.recv()
                if isinstance(frame, InferenceRequest):
                    self.frames[frame.request_id] = frame
                    self.requests.append(frame.request_id)
                    if self.answer_text is not None:
                        await self.provider.answer(frame, self.answer_text)
                elif isinstance(frame, Cancel):
                    self.cancels.append(frame.request_id)
        except Exception:  # noqa: BLE001 - the socket closed
            pass
        finally:
            beats.cancel()

    async def _heartbeats(self) -> None:
        assert self.provider.ws is not None
        while True:
            await asyncio.sleep(self.heartbeat_every)
            await self.provider.ws.send(dump(self.provider.heartbeat()))

    def report_loaded(self, models: tuple[str, ...]) -> None:
        """From now on the node has these models in memory: a heartbeat says so at once."""
        async def beat() -> None:
            assert self.provider.ws is not None
            self.provider.loaded = models
            await self.provider.ws.send(dump(self.provider.heartbeat()))
        self._call(beat())

    def _call(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(10)

    def chunk(self, request_id: str, text: str) -> None:
        self._call(self.provider.send_chunk(self.frames[request_id], text))

    def complete(self, request_id: str, prompt_tokens: int = 3, completion_tokens: int = 2) -> None:
        self._call(self.provider.send_complete(self.frames[request_id], prompt_tokens, completion_tokens))

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            await self.provider.close()
            if self._task is not None:
                self._task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self._loop)
        self._thread.join(10)


def _tampered(attestation: str) -> str:
    """The blob with one bit of its signature flipped: the body still matches the frame, but the
    signature no longer verifies under the identity key."""
    import base64

    blob = json.loads(base64.b64decode(attestation))
    signature = bytearray(base64.b64decode(blob["signature"]))
    signature[0] ^= 0x01
    blob["signature"] = base64.b64encode(bytes(signature)).decode()
    return base64.b64encode(json.dumps(blob).encode()).decode()
