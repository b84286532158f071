"""One connected provider as the coordinator sees it (a fresh ``prov_`` id per connection).

A session reaches its node through its ``Link`` (``fleet/link.py``): the node's WebSocket on this
replica or, for a session another replica holds, that replica. The node's frames for a request come
back to the session, which delivers them to the ``Inbox`` the request's attempt opened when it was
dispatched, and distrusts the provider when a chunk does not open or a usage is impossible — one
path for the frames of this replica's socket (``fleet/connection.py``) and for those another
replica's holder passes back (``fabric/remote_link.py``).

What the registry's views of free sessions depend on (and the replica fabric announces) — the active
count, decode speed, loaded models, online, draining, trust, runtime verification, owner, last passed
challenge — is read as plain attributes and changed only by the methods below, each of which tells
the session's ``Listing`` (the registry, while it lists the session) which kind of change it made:
one that moves it within its views (``reorder``) or one that may move it into or out of a view
(``refile``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Protocol

from nacl.public import PublicKey

from darkbloom.coordinator.fleet.enrollment import EnrollmentCA
from darkbloom.coordinator.fleet.link import Inbox, Link
from darkbloom.coordinator.fleet.machine_book import MachineBook
from darkbloom.store.machines import Seen
from darkbloom.wire.crypto import ReplyKey
from darkbloom.wire.protocol import Envelope, Heartbeat, Register, TrustStatus, Usage, dump

log = logging.getLogger("darkbloom.sessions")

FRAME_TOO_LARGE = "frame_too_large"  # the code of a failure the coordinator gives a frame it refused as too large
UNTRUSTED = "untrusted"  # the trust users and the node see once a check failed
MACHINE_SEEN_EVERY = 60.0  # seconds between two marks of a connected machine that says nothing new


class Listing(Protocol):
    """Where a listed session reports its changes (``fleet.registry.Registry``)."""

    def reorder(self, session: "ProviderSession") -> None:
        """Its active count, decode speed or loaded models changed: its place within its views."""

    def refile(self, session: "ProviderSession") -> None:
        """Something its views admit it by changed: which views it belongs to."""

    def disowned(self, session: "ProviderSession", account_id: str | None, machine_id: str | None) -> None:
        """It is no longer the machine ``machine_id`` of ``account_id``."""


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
    trust_level: str = "none"                # what it proved at registration (raised by an enrollment)
    runtime_verified: bool = False           # runtime hash in the coordinator's allow-list
    untrusted_reason: str | None = None      # set once the session fails a check; never routable again
    book: MachineBook | None = None          # held here: where it marks its machine (another replica's: None)
    connected_at: float = field(default_factory=time.monotonic)  # its socket's accept (monotonic)
    last_frame_at: float = field(default_factory=time.monotonic)
    online: bool = False                     # listed as routable only after registration completes
    inboxes: dict[str, Inbox] = field(default_factory=dict)  # request id → where its frames go
    advertised_models: frozenset[str] = frozenset()
    loaded_models: frozenset[str] = frozenset()  # the advertised ids the node has in memory now
    challenge_passed_at: float | None = None  # monotonic time of the last passed attestation challenge
    decode_tps: float = 0.0                  # measured completion tokens per second (EWMA)
    draining: bool = False                   # finishing in-flight work before it closes; takes nothing new
    machine_seen_at: float = 0.0             # monotonic time it last marked its machine
    machine_marked: Seen | None = None       # what that mark said
    _active: int = 0                         # claimed slots; only fleet.slots changes it
    _listing: Listing | None = field(default=None, init=False, repr=False)
    _spare_key: ReplyKey | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.advertised_models = frozenset(m.id for m in self.registration.models)
        loaded = self.registration.loaded_models
        self.loaded_models = self.advertised_models if loaded is None else self.advertised_models.intersection(loaded)

    # listed in the registry, which files it by what the methods below change

    def listed_in(self, listing: Listing) -> None:
        self._listing = listing

    def unlisted(self) -> None:
        """Taken out of the registry: offline, and no longer reporting its changes."""
        self._listing = None
        self.online = False

    def _reordered(self) -> None:
        if self._listing is not None:
            self._listing.reorder(self)

    def _refiled(self) -> None:
        if self._listing is not None:
            self._listing.refile(self)

    def claim_slot(self) -> None:
        """One more slot in use (``fleet.slots``, the only caller)."""
        self._active += 1
        self._reordered()

    def release_slot(self) -> None:
        """One slot fewer in use; never below zero (a stand-in's count is its holder's, overwritten by
        the announcements)."""
        self._active = max(0, self._active - 1)
        self._reordered()

    def mirror_active(self, active: int) -> None:
        """A stand-in takes the count its holder announced (``fleet.slots.mirror``)."""
        self._active = active
        self._reordered()

    def report_speed(self, decode_tps: float) -> None:
        """Its measured decode speed is now ``decode_tps`` (the replica's link passes it on, if need be)."""
        self.decode_tps = decode_tps
        self._reordered()

    def report_loaded(self, model_ids: Iterable[str]) -> None:
        """The node says which of its models are in memory now (ids it never advertised are ignored)."""
        loaded = self.advertised_models.intersection(model_ids)
        if loaded != self.loaded_models:
            self.loaded_models = loaded
            self._reordered()

    def mark_online(self) -> None:
        """Registered: routable from now on (if trusted)."""
        self.online = True
        self._refiled()

    def start_draining(self) -> None:
        """It finishes what it serves and takes nothing new."""
        if not self.draining:
            self.draining = True
            self._refiled()

    def record_challenge_pass(self, at: float | None) -> None:
        """It last passed an attestation challenge at ``at`` (monotonic; None: not yet)."""
        self.challenge_passed_at = at
        self._refiled()

    def raise_trust(self, level: str) -> None:
        """It proved ``level`` (an enrollment, or its holder says so)."""
        self.trust_level = level
        self._refiled()

    def distrusted_elsewhere(self, reason: str) -> None:
        """Another replica found it untrustworthy (its holder announced it): untrusted here too."""
        if self.untrusted_reason is None:
            self.untrusted_reason = reason
            self._refiled()

    def distrust(self, reason: str) -> None:
        """Mark it untrusted for good: it stays connected and ``online`` (listed, with trust ``untrusted``)
        but no routing path may use it. The node is told with a ``trust_status`` frame (at registration
        the ``registered`` frame carries it; another replica's session: its holder is told) and the
        machine is marked."""
        if self.untrusted_reason is not None:
            return
        self.untrusted_reason = reason
        self._refiled()
        log.warning("provider %s marked untrusted: %s", self.id, reason)
        if self.online:
            self.send(dump(TrustStatus(trust_level=UNTRUSTED, reason=reason)))
            self.mark_machine()

    def enrolled(self, certificate: str, ca: EnrollmentCA) -> None:
        """An admin enrolled its machine: hand the node its certificate (it presents it at later
        registrations) and, when it proved ``self_signed`` with the certified key and is trusted, raise
        it to ``hardware`` now."""
        if ca.verify(certificate, self.registration.identity_key) is not None:
            return  # issued for another identity key than this session's
        if self.trust_level == "self_signed" and self.untrusted_reason is None:
            self.raise_trust("hardware")
        level = self.effective_trust
        reason = "enrolled" if level == "hardware" else \
            f"enrolled; this session stays {level} (hardware trust needs a valid attestation)"
        self.send(dump(TrustStatus(trust_level=level, reason=reason, certificate=certificate)))
        log.info("provider %s enrolled (machine %s): trust %s", self.id, self.machine_id, level)
        if self.online:
            self.mark_machine()

    def disown(self) -> None:
        """Its machine was unlinked: it is no longer anyone's own machine."""
        account_id, machine_id = self.account_id, self.machine_id
        self.account_id = self.machine_id = None
        if self._listing is not None:
            self._listing.disowned(self, account_id, machine_id)

    def retire(self) -> None:
        """Its machine was unlinked: nobody's own machine from now on, it takes nothing new and closes
        once idle — closed by the replica that holds it (told so when it is another one)."""
        self.disown()
        self.start_draining()
        self.link.retire()

    @property
    def effective_trust(self) -> str:
        """What users and the node see: ``untrusted`` once a check failed, else the proven level."""
        return UNTRUSTED if self.untrusted_reason is not None else self.trust_level

    # what it says of its machine, marked on the machine book (which writes it with its next batch)

    def mark_machine(self) -> None:
        """Mark the machine with what the session says now (only the time, when nothing else changed)."""
        if self.book is None or self.machine_id is None:
            return
        seen = Seen(last_seen=int(time.time()), models=sorted(self.advertised_models),
                    trust_level=self.effective_trust, private_only=self.private_only,
                    name=self.registration.name or None, identity_key=self.registration.identity_key or None)
        if self.machine_marked is not None and replace(self.machine_marked, last_seen=seen.last_seen) == seen:
            self.book.touch(self.machine_id, seen.last_seen)
        else:
            self.book.mark(self.machine_id, seen)
        self.machine_seen_at, self.machine_marked = time.monotonic(), seen

    def heartbeat(self, frame: Heartbeat) -> None:
        """The node's heartbeat: the models it has loaded now, and its machine marked seen once a minute."""
        if "models" in frame.model_fields_set:  # the models loaded now (the scheduler prefers those)
            self.report_loaded(frame.models)
        if time.monotonic() - self.machine_seen_at >= MACHINE_SEEN_EVERY:
            self.mark_machine()

    def unchanged_heartbeats_idle_for(self) -> float:
        """Seconds for which heartbeats identical to the one about to reach ``heartbeat`` tell it nothing
        (their arrival still counts for liveness): until the machine is next due to be marked seen, a
        whole ``MACHINE_SEEN_EVERY`` when this heartbeat is the one that marks it."""
        due_in = self.machine_seen_at + MACHINE_SEEN_EVERY - time.monotonic()
        return due_in if due_in > 0 else MACHINE_SEEN_EVERY

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
        """A frame arrived at ``at`` (monotonic)."""
        self.last_frame_at = at

    def send(self, frame_json: str) -> None:
        self.link.send(frame_json)

    def close(self, code: int = 1000) -> None:
        self.link.close(code)

    # the node's frames, delivered to the inbox of their request (none: the request is over here); a chunk
    # that does not open or a usage the request could not have used makes the provider untrusted

    def open_inbox(self, request_id: str, inbox: Inbox) -> None:
        self.inboxes[request_id] = inbox

    def close_inbox(self, request_id: str, inbox: Inbox) -> None:
        """Later frames for the request are ignored."""
        if self.inboxes.get(request_id) is inbox:
            del self.inboxes[request_id]

    def deliver_chunk(self, request_id: str, envelope: Envelope) -> None:
        inbox = self.inboxes.get(request_id)
        if inbox is not None and not inbox.on_chunk(envelope):
            self.distrust("a response chunk did not open")

    def deliver_complete(self, request_id: str, usage: Usage) -> None:
        inbox = self.inboxes.get(request_id)
        if inbox is not None and not inbox.on_complete(usage):
            self.distrust("it reported impossible token usage")

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
