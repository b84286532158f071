"""One connected provider as the coordinator sees it (a fresh ``prov_`` id per connection).

A session reaches its node through its ``Link``: the WebSocket of this replica
(``fleet.socket_link.SocketLink``) or, for a session another replica holds, that replica
(``fabric.remote_link.RemoteLink``). The node's frames for a request come back to the session,
which delivers them to the ``Inbox`` the request's attempt opened when it was dispatched
(``inference.attempt.Attempt``; on a holding replica, ``fabric.holder.Forwarder``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from nacl.public import PublicKey

from darkbloom.store.machines import Seen
from darkbloom.wire.crypto import ReplyKey
from darkbloom.wire.protocol import Envelope, Register, Usage

# what the registry's views of free sessions depend on (and the replica fabric announces): setting one
# of these calls the session's ``_watch`` (the registry's, while the session is listed), whoever sets it
WATCHED = frozenset({"_active", "decode_tps", "online", "draining", "untrusted_reason", "trust_level",
                     "runtime_verified", "public_key", "account_id", "challenge_passed_at", "loaded_models"})
FRAME_TOO_LARGE = "frame_too_large"  # the code of a failure the coordinator gives a frame it refused as too large


class Link(Protocol):
    """Everything that differs between a session on this replica's socket and one another replica
    holds; nothing above the link asks which one it has."""

    only_proven_chunks: bool  # every chunk it carries is sealed with the node's registered key

    @property
    def closing(self) -> bool:
        """Closing the node's socket was asked for here (that link takes no new work)."""

    def send(self, frame_json: str) -> None:
        """A frame for the node (never blocks, never interleaves with another)."""

    def send_request(self, request_id: str, ticket: str | None, frame_json: str) -> None:
        """The sealed ``inference_request`` of an attempt on the slot claimed under ``ticket``."""

    def cancel(self, request_id: str, ticket: str | None) -> None:
        """Tell the node to stop the request (it reports the usage so far)."""

    def claimed(self) -> str | None:
        """A slot was claimed: the ticket the session's holder knows the claim by (None here)."""

    async def confirm(self, ticket: str | None) -> bool:
        """Whether the slot claimed under ``ticket`` really is the session's."""

    def released(self, ticket: str | None) -> None:
        """The slot claimed under ``ticket`` was given back."""

    def report_speed(self, decode_tps: float) -> None:
        """This replica measured the session's decode speed."""

    def retire(self, close_here: Callable[[], object]) -> None:
        """The machine was unlinked: the replica whose socket it is closes the session once idle
        (``close_here`` when that is this one)."""

    def close(self, code: int = 1000) -> None:
        """Close the node's socket once the frames queued before now are sent."""


class Inbox(Protocol):
    """Where a session delivers the node's frames for one request."""

    def on_chunk(self, envelope: Envelope) -> bool:
        """False when the chunk does not open (the caller distrusts the provider)."""

    def on_complete(self, usage: Usage) -> bool:
        """False when the usage is impossible for the request (the caller distrusts the provider)."""

    def on_error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        """The node failed the request."""

    def on_provider_gone(self) -> None:
        """The node went away before finishing the request."""

    def unread(self) -> int:
        """Chunks delivered and not yet relayed."""


@dataclass(eq=False)
class ProviderSession:
    """One connected provider (a fresh ``prov_`` id per connection). With replicas, the sessions other
    replicas hold are listed too, as stand-ins whose link goes to their holder."""

    id: str
    account_id: str | None           # stamped from the device token at registration; None = unowned
    machine_id: str | None
    registration: Register
    public_key: PublicKey | None
    link: Link
    trust_level: str = "none"
    connected_at: float = field(default_factory=time.monotonic)  # its socket's accept (monotonic)
    last_frame_at: float = field(default_factory=time.monotonic)
    _active: int = 0                  # claimed slots; only fleet.slots changes it
    online: bool = False              # listed as routable only after registration completes
    inboxes: dict[str, Inbox] = field(default_factory=dict)  # request id → where its frames go
    advertised_models: frozenset[str] = frozenset()
    loaded_models: frozenset[str] = frozenset()  # the advertised ids the node has in memory now
    untrusted_reason: str | None = None      # set once the session fails a check; never routable again
    runtime_verified: bool = False           # runtime hash in the coordinator's allow-list
    challenge_passed_at: float | None = None  # monotonic time of the last passed attestation challenge
    decode_tps: float = 0.0                  # measured completion tokens per second (EWMA)
    draining: bool = False                   # finishing in-flight work before it closes; takes nothing new
    machine_seen_at: float = 0.0             # monotonic time it last marked its machine (fleet/machine_book.py)
    machine_marked: Seen | None = None       # what that mark said
    _watch: Callable[["ProviderSession", str], None] | None = field(default=None, init=False, repr=False)
    _spare_key: ReplyKey | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.advertised_models = frozenset(m.id for m in self.registration.models)
        loaded = self.registration.loaded_models
        self.loaded_models = self.advertised_models if loaded is None else self.advertised_models.intersection(loaded)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in WATCHED:
            watch = self.__dict__.get("_watch")
            if watch is not None:
                watch(self, name)

    @property
    def max_concurrency(self) -> int:
        return self.registration.max_concurrency

    @property
    def private_only(self) -> bool:
        return self.registration.private_only

    @property
    def active(self) -> int:
        return self._active

    @property
    def has_free_slot(self) -> bool:
        return self.active < self.max_concurrency

    def report_loaded(self, model_ids: Iterable[str]) -> None:
        """The node says which of its models are in memory now (ids it never advertised are ignored)."""
        loaded = self.advertised_models.intersection(model_ids)
        if loaded != self.loaded_models:
            self.loaded_models = loaded

    def has_loaded(self, names: tuple[str, ...]) -> bool:
        """Whether the node has the model (one of its names) in memory now."""
        return not self.loaded_models.isdisjoint(names)

    def context_for(self, names: tuple[str, ...]) -> int:
        """The context length the node serves the model (its names) with; 0 when it does not say."""
        lengths = [m.context_length for m in self.registration.models if m.id in names]
        return 0 if not lengths or 0 in lengths else max(lengths)

    def size_for(self, names: tuple[str, ...]) -> int:
        """The size in bytes of the node's weights for the model (0 when it does not say)."""
        return max((m.size_bytes for m in self.registration.models if m.id in names), default=0)

    @property
    def chunks_proven(self) -> bool:
        """Whether its chunks are sealed with the node's registered key, so that they prove their node."""
        return self.registration.authenticated_chunks or self.link.only_proven_chunks

    def reply_key(self) -> ReplyKey:
        """A fresh key pair for one request to this node, to which its replies are sealed (from the
        node's registered key, when its chunks prove it), its key agreement with the node's key made:
        the one ``prepare_reply_key`` made ahead, else a new one. Each is used once."""
        key, self._spare_key = self._spare_key, None
        return key if key is not None else self._new_reply_key()

    def prepare_reply_key(self) -> None:
        """Make the next request's reply key once the loop has run what is ready now — the frame just
        queued for this node among it — so at one request at a time a dispatch does not wait for it."""
        asyncio.get_running_loop().call_soon(self._make_spare_key)

    def _new_reply_key(self) -> ReplyKey:
        key = ReplyKey(self.registration.public_key if self.chunks_proven else None)
        return key if self.public_key is None else key.prepare(self.public_key)

    def _make_spare_key(self) -> None:
        if self._spare_key is None and self.online:
            self._spare_key = self._new_reply_key()

    def heard(self, at: float) -> None:
        """A frame arrived at ``at`` (monotonic). ``last_frame_at`` is not watched: set without the detour."""
        self.__dict__["last_frame_at"] = at

    def send(self, frame_json: str) -> None:
        self.link.send(frame_json)

    def close(self, code: int = 1000) -> None:
        self.link.close(code)

    # the node's frames, delivered to the inbox of their request (none: the request is over here)

    def open_inbox(self, request_id: str, inbox: Inbox) -> None:
        self.inboxes[request_id] = inbox

    def close_inbox(self, request_id: str, inbox: Inbox) -> None:
        """Later frames for the request are ignored."""
        if self.inboxes.get(request_id) is inbox:
            del self.inboxes[request_id]

    def deliver_chunk(self, request_id: str, envelope: Envelope) -> bool:
        inbox = self.inboxes.get(request_id)
        return inbox is None or inbox.on_chunk(envelope)

    def deliver_complete(self, request_id: str, usage: Usage) -> bool:
        inbox = self.inboxes.get(request_id)
        return inbox is None or inbox.on_complete(usage)

    def deliver_error(self, request_id: str, status: int, message: str, param: str | None = None,
                      code: str | None = None) -> None:
        inbox = self.inboxes.get(request_id)
        if inbox is not None:
            inbox.on_error(status, message, param, code)

    def deliver_gone(self, request_id: str) -> None:
        inbox = self.inboxes.get(request_id)
        if inbox is not None:
            inbox.on_provider_gone()

    def unread(self, request_id: str) -> int:
        inbox = self.inboxes.get(request_id)
        return 0 if inbox is None else inbox.unread()

    def disconnected(self) -> None:
        """The node is gone: every request still on the session fails as a disconnected provider's."""
        for inbox in list(self.inboxes.values()):
            inbox.on_provider_gone()
