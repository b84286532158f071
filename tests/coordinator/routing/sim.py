"""Simulated provider sessions in an in-memory ``Registry``, for scheduler, queue and attempt tests.

A ``SimProvider`` is a real ``ProviderSession`` (built from a ``protocol.Register`` frame with a real
X25519 key) plus the node side a test needs: it reads the frames the coordinator queued on the
session's socket link (``outbox``) and answers an ``inference_request`` by calling the inbox the
attempt opened on the session, as the socket reader's deliveries do, with chunks sealed to the
request's reply key.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

from darkbloom.wire.catalog import BUNDLED_MODEL_ID, CatalogModel
from darkbloom.coordinator.inference.calls import InferenceCall, parse_call
from darkbloom.wire.openai.edges import CHAT
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.slots import Slot, Slots
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.routing.decision import RouteDecision, ShareGrant
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.settlement import RequestLifecycle
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import NodeIdentity, Sealer, open_envelope, public_key_from_b64
from darkbloom.wire.protocol import Cancel, InferenceRequest, ModelInfo, Register, Usage, parse_coordinator_frame
from darkbloom.coordinator.fleet.connection import OutboxLink

MODEL = CatalogModel(id=BUNDLED_MODEL_ID, aliases=["smollm2"], input_price=50_000, output_price=200_000)
GOOD_HASH = "sha256:" + "a" * 64  # the catalog pins this one
BAD_HASH = "sha256:" + "b" * 64
RUNTIME = "sha256:" + "ab" * 32
_ids = itertools.count(1)


def settings(**fields: Any) -> CoordinatorSettings:
    values: dict[str, Any] = dict(database_url="sqlite+aiosqlite:///:memory:", min_trust="self_signed",
                                  runtime_allow_list=frozenset({RUNTIME}), first_content_timeout=0.4,
                                  queue_max_wait=5.0, queue_depth=8)
    values.update(fields)
    return CoordinatorSettings(**values)


def services(registry: Registry, config: CoordinatorSettings | None = None) -> Services:
    """Everything ``Attempts`` and ``RequestQueues`` touch; no database, no rate limiter."""
    return Services(settings=config or settings(), engine=None, registry=registry,  # type: ignore[arg-type]
                    rate_limiter=None)  # type: ignore[arg-type]


def lifecycle(svc: Services, request_id: str = "chatcmpl-sim") -> RequestLifecycle:
    """A request's lifecycle with nothing taken yet (no rate charges, no reservation)."""
    return RequestLifecycle(svc, Caller(account_id="acct_sim", kind="api_key"), request_id, CHAT.path)


async def end_as_gone(life: RequestLifecycle) -> None:
    """End the request as the pipeline does when its client vanished, and wait for the bookkeeping."""
    gone = asyncio.CancelledError()
    await life.__aexit__(type(gone), gone, None)
    await life.services.drain(timeout=5)


class NoLifecycle:
    """A request lifecycle as placement sees it (``routing.route.Holder``), keeping nothing: its slots
    are the test's to release, and a share's allowance is always there."""

    def hold(self, slot: Slot) -> None:
        pass

    async def take_share(self, grant: ShareGrant) -> bool:
        return True


def decision(**fields: Any) -> RouteDecision:
    return RouteDecision(model=fields.pop("model", MODEL), **fields)


def chat(**fields: Any) -> InferenceCall:
    body = {"model": BUNDLED_MODEL_ID, "messages": [{"role": "user", "content": "hello"}], **fields}
    return parse_call(json.dumps(body).encode(), CHAT)


class SimProvider:
    def __init__(self, *, models: tuple[str, ...] = (BUNDLED_MODEL_ID,), account: str | None = None,
                 machine: str | None = None, trust: str = "self_signed", max_concurrency: int = 1,
                 private_only: bool = False, vision: bool = False, weight_hash: str = "",
                 encrypted: bool = True, with_key: bool = True, runtime_verified: bool = True,
                 challenge_age: float | None = 0.0, untrusted: str | None = None, online: bool = True,
                 decode_tps: float = 0.0, active: int = 0, session_id: str | None = None,
                 capabilities: tuple[str, ...] = (), context_length: int = 0, size_bytes: int = 0,
                 loaded: tuple[str, ...] | None = None) -> None:
        self.identity = NodeIdentity.generate()
        register = Register(
            auth_token=None, models=[ModelInfo(id=m, weight_hash=weight_hash, is_vision=vision,
                                               capabilities=list(capabilities), context_length=context_length,
                                               size_bytes=size_bytes) for m in models],
            backend="sim", version="test", runtime_hash=RUNTIME, public_key=self.identity.public_key_b64,
            identity_key=self.identity.identity_key_b64, encrypted_response_chunks=encrypted,
            private_only=private_only, max_concurrency=max_concurrency,
            loaded_models=None if loaded is None else list(loaded))
        self.link = OutboxLink()
        self.session = ProviderSession(
            id=session_id or f"prov_sim{next(_ids):04d}", account_id=account, machine_id=machine,
            registration=register, public_key=public_key_from_b64(register.public_key) if with_key else None,
            link=self.link, trust_level=trust, runtime_verified=runtime_verified, untrusted_reason=untrusted,
            challenge_passed_at=None if challenge_age is None else time.monotonic() - challenge_age,
            decode_tps=decode_tps, online=online)
        self.held: list[Slot] = []  # slots claimed for the test (``set_active``), as busy work would
        self._slots = Slots()
        self.set_active(active)
        self._requests: dict[str, InferenceRequest] = {}
        self.seen: list[Any] = []  # every frame read from the outbox, in order

    def set_active(self, count: int) -> None:
        """Claim or release slots until ``count`` are in use (through the one slot API)."""
        while len(self.held) > count:
            self.held.pop().release()
        while len(self.held) < count:
            self.held.append(self._slots.claim(self.session))

    @property
    def id(self) -> str:
        return self.session.id

    # frames the coordinator sent

    def _take(self, raw: str | None) -> Any:
        assert raw is not None, "the coordinator closed this session"
        frame = parse_coordinator_frame(raw)
        self.seen.append(frame)
        if isinstance(frame, InferenceRequest):
            self._requests[frame.request_id] = frame
        return frame

    def frames(self) -> list[Any]:
        """Read everything queued so far (non-blocking); returns all frames seen."""
        while not self.link.outbox.empty():
            self._take(self.link.outbox.get_nowait())
        return self.seen

    async def next_frame(self, timeout: float = 2.0) -> Any:
        return self._take(await asyncio.wait_for(self.link.outbox.get(), timeout))

    async def next_request(self, timeout: float = 2.0) -> InferenceRequest:
        while True:
            frame = await self.next_frame(timeout)
            if isinstance(frame, InferenceRequest):
                return frame

    def requests(self) -> list[str]:
        return [f.request_id for f in self.frames() if isinstance(f, InferenceRequest)]

    def cancels(self) -> list[str]:
        return [f.request_id for f in self.frames() if isinstance(f, Cancel)]

    def body(self, request_id: str) -> dict[str, Any]:
        """The plaintext body, opened with this node's key (proves it was sealed to it)."""
        request = self._requests[request_id]
        return dict(json.loads(open_envelope(request.encrypted_body, self.identity.encryption_key)))

    # answering, as the provider socket reader would

    def reply(self, request_id: str, text: str = "hi") -> None:
        """One sealed content chunk for the request (sealed to its reply key)."""
        request = self._requests[request_id]
        sealer = Sealer(public_key_from_b64(request.encrypted_body.ephemeral_public_key))
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]}
        assert self.session.inboxes[request_id].on_chunk(sealer.seal(json.dumps(chunk).encode()))

    def complete(self, request_id: str) -> None:
        self.session.inboxes[request_id].on_complete(Usage(prompt_tokens=3, completion_tokens=1))

    def error(self, request_id: str, status: int, message: str = "failed") -> None:
        self.session.inboxes[request_id].on_error(status, message)

    def gone(self, request_id: str) -> None:
        self.session.inboxes[request_id].on_provider_gone()


def fleet(registry: Registry, count: int, **fields: Any) -> list[SimProvider]:
    """Sessions in the registry; their busy slots come from the registry's slots, so releasing one
    wakes the registry's queues as a real release does."""
    active = fields.pop("active", 0)
    providers = [SimProvider(**fields) for _ in range(count)]
    for provider in providers:
        registry.add(provider.session)
        provider._slots = registry.slots
        provider.set_active(active)
    return providers


async def dispatched(providers: list[SimProvider], timeout: float = 2.0) -> SimProvider:
    """The one provider that receives the request next."""
    async def watch(provider: SimProvider) -> SimProvider:
        await provider.next_request(timeout)
        return provider

    tasks = [asyncio.ensure_future(watch(p)) for p in providers]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        assert done, "no provider received the request"
        return done.pop().result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
