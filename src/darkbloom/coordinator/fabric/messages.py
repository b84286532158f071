"""What replicas say to each other over NATS: the announcement of a session, the messages to the
replica holding a session, and the provider's frames back to the replica that admitted a request.

Everything here is metadata or ciphertext: a session's public facts (the fields routing reads, never
its device token), a sealed ``inference_request`` frame exactly as the node's WebSocket gets it, the
sealed response chunks exactly as the node sent them, usage counts and ids. No prompt or completion
is ever in a message, because the replica that admitted a request is the only one with its keys.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from darkbloom.coordinator.fabric.authentication import refuse
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.wire import json_codec
from darkbloom.wire.crypto import b64e
from darkbloom.wire.protocol import Envelope, Hardware, ModelInfo, Register, Usage

log = logging.getLogger("darkbloom.fabric")
# the parts of a request frame bigger than the server's max_payload: this much room for the header
HEADER_ROOM = 1024
MAX_PARTS = 64  # a request frame (at most MAX_REQUEST_FRAME_BYTES, ~11 MiB) needs ~12 parts of 1 MiB


def announcement(session: ProviderSession, now: float | None = None) -> dict[str, Any]:
    """A session as other replicas see it: what the gates, the scheduler, the owned views and the
    Self-Route pre-flight read. Ages, not clock readings: monotonic clocks differ between hosts."""
    now = time.monotonic() if now is None else now
    registration = session.registration
    passed = session.challenge_passed_at
    return {
        "id": session.id, "account_id": session.account_id, "machine_id": session.machine_id,
        "models": [model.model_dump() for model in registration.models],
        "public_key": b64e(bytes(session.public_key)) if session.public_key is not None else None,
        "identity_key": registration.identity_key,
        "encrypted_response_chunks": registration.encrypted_response_chunks,
        "authenticated_chunks": registration.authenticated_chunks,
        "private_only": registration.private_only, "max_concurrency": registration.max_concurrency,
        "max_request_frame_bytes": registration.max_request_frame_bytes, "name": registration.name,
        "device": registration.hardware.device, "backend": registration.hardware.backend,
        "trust_level": session.trust_level, "untrusted_reason": session.untrusted_reason,
        "runtime_verified": session.runtime_verified, "draining": session.draining,
        "challenge_age": None if passed is None else max(0.0, now - passed),
        "connected_age": max(0.0, now - session.connected_at),
        "active": session.active, "decode_tps": session.decode_tps,
        # which of ``models`` are loaded now, by position: never longer than the list it points into
        "loaded": [index for index, model in enumerate(registration.models) if model.id in session.loaded_models],
    }


def facts_of(session: ProviderSession) -> tuple[object, ...]:
    """What ``announcement`` says of a session that can change, besides its load (active slots, decode
    speed): the advertiser sends a change of these at once and a change of load alone later. Its
    registration is not here: it does not change while the session lives. The last pass of a
    challenge comes last (``renewed_only``)."""
    return (session.online, session.account_id, session.machine_id, session.trust_level, session.untrusted_reason,
            session.runtime_verified, session.draining, session.loaded_models, session.challenge_passed_at)


def passed_at(facts: tuple[object, ...]) -> float | None:
    """The last pass of a challenge that ``facts_of`` says (monotonic), None before the first."""
    return cast("float | None", facts[-1])


def renewed_only(before: tuple[object, ...], after: tuple[object, ...]) -> bool:
    """Whether the one change between two ``facts_of`` is a challenge passed again (not a first pass)."""
    renewed_from, renewed_at = passed_at(before), passed_at(after)
    return before[:-1] == after[:-1] and renewed_from is not None and renewed_at not in (None, renewed_from)


def registration_of(announced: dict[str, Any]) -> Register:
    """The registration a stand-in carries: the announced facts only (no token, no attestation; of the
    hardware, where it runs its models — unknown from a replica that does not say)."""
    return Register(models=[ModelInfo.model_validate(m) for m in announced["models"]],
                    public_key=announced["public_key"] or "", identity_key=announced["identity_key"] or "",
                    encrypted_response_chunks=bool(announced["encrypted_response_chunks"]),
                    authenticated_chunks=bool(announced["authenticated_chunks"]),
                    private_only=bool(announced["private_only"]), max_concurrency=announced["max_concurrency"],
                    max_request_frame_bytes=announced["max_request_frame_bytes"], name=announced["name"] or "",
                    hardware=Hardware(device=announced.get("device"), backend=announced.get("backend")))


def loaded_of(announced: dict[str, Any], models: list[ModelInfo]) -> frozenset[str]:
    """The ids of the announced session's loaded models (all of them from a replica that does not say)."""
    loaded = announced.get("loaded")
    if not isinstance(loaded, list):
        return frozenset(model.id for model in models)
    return frozenset(models[index].id for index in loaded
                     if type(index) is int and 0 <= index < len(models))


# on ``<prefix>.fleet`` (every replica) and ``<prefix>.view.<replica>`` (one): JSON objects, ``k`` their kind


def encoded(value: Any) -> bytes:
    return json_codec.dumps(value)


def alive(replica: str, seq: int, count: int) -> bytes:
    """The heartbeat: this replica is alive, its last delta was ``seq`` and it lists ``count`` sessions."""
    return encoded({"k": "alive", "replica": replica, "seq": seq, "count": count})


def leaving(replica: str) -> bytes:
    """The last message of a replica that stops: every other replica drops its sessions at once."""
    return encoded({"k": "leaving", "replica": replica})


def sync_request(replica: str) -> bytes:
    """``replica`` asks for a full view: of everyone (on the fleet subject) or of one replica."""
    return encoded({"k": "sync", "replica": replica})


def packed(items: list[bytes], room: int) -> list[list[bytes]]:
    """``items`` (encoded JSON values), in order, in groups whose comma-joined size fits ``room``
    (an item bigger than ``room`` alone is a group of its own, which the connection then refuses)."""
    groups: list[list[bytes]] = []
    group: list[bytes] = []
    size = 0
    for item in items:
        if group and size + 1 + len(item) > room:
            groups.append(group)
            group, size = [], 0
        size += len(item) + (1 if group else 0)
        group.append(item)
    if group:
        groups.append(group)
    return groups


def _with_lists(head: dict[str, Any], lists: dict[str, list[bytes]]) -> bytes:
    """``head`` with JSON arrays of already encoded items (the sessions are not encoded twice)."""
    body = encoded(head)[:-1]
    for key, items in lists.items():
        body += b',"%s":[%s]' % (key.encode(), b",".join(items))
    return body + b"}"


# what a delta or a view part spends besides its items: its fields, with room for long ids and numbers
FLEET_OVERHEAD = 256


def fits(announced: bytes, room: int) -> bool:
    """Whether a session's announcement fits in a fleet message of ``room`` bytes."""
    return len(announced) <= room - FLEET_OVERHEAD


def deltas(replica: str, first_seq: int, changed: list[bytes], gone: list[str], room: int) -> list[bytes]:
    """The changed sessions (encoded announcements) and the gone ones (ids) in as many deltas as
    ``room`` needs, numbered from ``first_seq`` on."""
    items = [(b"S", item) for item in changed] + [(b"G", encoded(session_id)) for session_id in gone]
    # (the tag tells the lists apart; packing counts it, so each group leaves a byte to spare per item)
    groups = packed([tag + item for tag, item in items], room - FLEET_OVERHEAD)
    return [_with_lists({"k": "delta", "replica": replica, "seq": first_seq + offset},
                        {"sessions": [item[1:] for item in group if item[:1] == b"S"],
                         "gone": [item[1:] for item in group if item[:1] == b"G"]})
            for offset, group in enumerate(groups)]


def view(replica: str, seq: int, number: int, sessions: list[bytes], room: int) -> list[bytes]:
    """A replica's full view — every session it lists, as of its delta ``seq`` — in as many parts as
    ``room`` needs; ``number`` tells the parts of one answer from another's."""
    groups = packed(sessions, room - FLEET_OVERHEAD) or [[]]
    return [_with_lists({"k": "view", "replica": replica, "seq": seq, "view": number, "part": index,
                         "parts": len(groups)}, {"sessions": group})
            for index, group in enumerate(groups)]


# to the holder: one JSON header line, then the frame (bytes) it carries, if any


def hold_message(kind: str, payload: bytes = b"", **header: Any) -> bytes:
    return json_codec.dumps({"k": kind, **header}) + b"\n" + payload


def hold_parts(kind: str, payload: bytes, max_payload: int, **header: Any) -> list[bytes]:
    """A frame in as many messages as the server's ``max_payload`` needs (``p`` of ``n``)."""
    size = max(1, max_payload - HEADER_ROOM)
    pieces = [payload[i:i + size] for i in range(0, len(payload), size)] or [b""]
    return [hold_message(kind, piece, p=index, n=len(pieces), **header) for index, piece in enumerate(pieces)]


class SplitFrames:
    """Frames sent in parts (``hold_parts``) put back together. The parts of one ticket arrive in
    order, from the replica that sent the first; at most ``max_buffered`` bytes of unfinished frames
    are kept per sending replica."""

    def __init__(self, max_buffered: int) -> None:
        self.max_buffered = max_buffered
        self._parts: dict[str, tuple[str, float, list[bytes]]] = {}  # ticket → (sender, first arrival, parts)
        self._bytes: dict[str, int] = {}  # sender → bytes of its unfinished frames

    def add(self, sender: str, header: dict[str, Any], payload: bytes) -> bytes | None:
        """The frame once all its parts are in; None until then, or when it can never be whole."""
        count = int(header.get("n", 1))
        if count == 1:
            return payload
        ticket = str(header["t"])
        if not 1 < count <= MAX_PARTS:
            log.warning("a frame in %s parts for %s: dropped", count, ticket)
            return None
        entry = self._parts.get(ticket)
        if entry is not None and entry[0] != sender:
            refuse("impersonation", "replica %s sent a part of replica %s's frame", sender, entry[0])
            return None
        if self._bytes.get(sender, 0) + len(payload) > self.max_buffered:
            refuse("over_limit", "replica %s has more than %d bytes of unfinished frames here", sender,
                   self.max_buffered)
            self._drop(ticket)
            return None
        _, _, parts = self._parts.setdefault(ticket, (sender, time.monotonic(), []))
        if int(header.get("p", len(parts))) != len(parts):  # a part went missing: the frame cannot be whole
            log.warning("a part of the frame for %s went missing: dropped", ticket)
            self._drop(ticket)
            return None
        parts.append(payload)
        self._bytes[sender] = self._bytes.get(sender, 0) + len(payload)
        if len(parts) < count:
            return None
        self._drop(ticket)
        return b"".join(parts)

    def forget(self, sender: str) -> None:
        for ticket in [t for t, (by, _, _) in self._parts.items() if by == sender]:
            self._drop(ticket)

    def reap(self, started_before: float) -> None:
        for ticket in [t for t, (_, since, _) in self._parts.items() if since < started_before]:
            self._drop(ticket)

    def __len__(self) -> int:
        return len(self._parts)

    def _drop(self, ticket: str) -> None:
        entry = self._parts.pop(ticket, None)
        if entry is None:
            return
        sender, _, parts = entry
        left = self._bytes.get(sender, 0) - sum(map(len, parts))
        if left > 0:
            self._bytes[sender] = left
        else:
            self._bytes.pop(sender, None)


def read_hold(data: bytes) -> tuple[dict[str, Any], bytes]:
    header, _, payload = data.partition(b"\n")
    return json_object(header), payload


def json_object(data: bytes) -> dict[str, Any]:
    """A message's JSON object (ValueError for anything else)."""
    body = json_codec.loads(data)
    if not isinstance(body, dict):
        raise ValueError("a fabric message is a JSON object")
    return body


# back to the admitting replica, on the attempt's own subject: batches of these items


def back_batch(items: list[bytes]) -> bytes:
    """What one message back carries: the items below, in order (the frames of one loop turn)."""
    return b"[" + b",".join(items) + b"]"


def back_items(body: bytes) -> list[dict[str, Any]]:
    """The items of a message back (a JSON array of objects; ValueError for anything else)."""
    items = json_codec.loads(body)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError("a message back is a JSON array of objects")
    return items


def back_chunk(envelope: Envelope) -> bytes:
    return b'{"k":"chunk","e":' + envelope.model_dump_json().encode() + b"}"


def back_complete(usage: Usage, account_id: str | None) -> bytes:
    """The provider's usage, with the owner of the session that served it read on the holder now."""
    return json_codec.dumps({"k": "complete", "usage": usage.model_dump(), "account_id": account_id})


def back_error(status: int, message: str, param: str | None, code: str | None) -> bytes:
    return json_codec.dumps({"k": "error", "status": status, "message": message, "param": param, "code": code})


def back_gone(why: str = "gone") -> bytes:
    """The session disconnected (``gone``), or had no free slot for an unconfirmed claim (``busy``)."""
    return json_codec.dumps({"k": why})


def claim_request(session_id: str, ticket: str, replica: str) -> bytes:
    return json_codec.dumps({"session": session_id, "ticket": ticket, "from": replica})


def claim_reply(ok: bool, why: str = "") -> bytes:
    return json_codec.dumps({"ok": ok, "why": why})
