"""Who said it: every fabric message proves it comes from a live replica of this coordinator.

Each replica process has its own Ed25519 key, random per process as its instance id is, and writes
its public half beside its instance row in the shared database, which only the replicas can write;
the others read it from there (``Roster``). A message is one line of proof, then its body:

    DBA1 <sender> <to> <seq> <ms> <tag>\\n<body>

- to ``*`` (the fleet announcements, which every replica reads): ``tag`` is the sender's Ed25519
  signature;
- to one replica: ``tag`` is keyed BLAKE2b under the key the two replicas share (X25519 between
  their keys): a few µs where a signature costs tens to check, and the chunks of every stream take it;

both over ``sender to subject seq ms`` and the body. ``seq`` counts the sender's messages and ``ms``
is its wall clock. A message is dropped, and counted in ``darkbloom_fabric_dropped_total{reason}``,
when it has no proof line, names a replica the database does not list as live, has a tag that does
not verify, is addressed to another replica, is more than ``MAX_SKEW_MS`` away from this replica's
clock or older than this replica's process (what was sent before it started was not sent to it: a
restarted replica remembers none of the ``seq`` it saw), or repeats a ``seq`` of its sender (each is
accepted once, within a window of the newest).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import Box
from nacl.signing import SigningKey, VerifyKey
from prometheus_client import Counter
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store.schema import coordinator_instances

log = logging.getLogger("darkbloom.fabric")
DROPPED = Counter("darkbloom_fabric_dropped_total",
                  "Fabric messages dropped because they did not prove a live replica sent them now, to this one",
                  ["reason"])

VERSION = b"DBA1"
EVERYONE = "*"
MAX_SKEW_MS = 30_000  # replicas' clocks agree this well (NTP); an older message is a replay
WINDOW = 1 << 14      # how far behind its sender's newest message one may arrive (subscriptions reorder)
MAX_LINE = 512
REFRESH_EVERY = 5.0   # seconds between reads of the live replicas' keys
REFRESH_AT_MOST = 1.0  # an unknown sender reads them again, at most this often (a flood costs one query a second)
_PERSON = b"darkbloom-fabric"


def refuse(reason: str, message: str, *args: object) -> None:
    """A message from a proven replica that it had no right to send: dropped, logged and counted."""
    DROPPED.labels(reason).inc()
    log.warning(message + ": dropped", *args)


class Rejected(Exception):
    """Why a message was dropped: the ``reason`` label of the metric."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Opened(NamedTuple):
    sender: str
    body: bytes


def _b64(data: bytes) -> bytes:
    return binascii.b2a_base64(data, newline=False)


def _unb64(data: bytes) -> bytes:
    return binascii.a2b_base64(data, strict_mode=True)


def _covered(sender: str, to: str, subject: str, seq: int, ms: int) -> bytes:
    """What the tag covers before the body."""
    return f"{sender} {to} {subject} {seq} {ms}\n".encode()


@dataclass
class Peer:
    replica: str
    verify_key: VerifyKey
    pair_key: bytes  # shared with this replica: MACs of the messages between the two
    _mac: "hashlib._Hash | None" = None

    def mac(self, covered: bytes, body: bytes) -> bytes:
        if self._mac is None:
            self._mac = hashlib.blake2b(key=self.pair_key, digest_size=32, person=_PERSON)
        keyed = self._mac.copy()
        keyed.update(covered)
        keyed.update(body)
        return keyed.digest()


class ReplayWindow:
    """Each sequence number once; none further than ``WINDOW`` behind the newest seen."""

    def __init__(self) -> None:
        self.newest = -1
        self._seen: set[int] = set()

    def admit(self, seq: int) -> bool:
        floor = self.newest - WINDOW
        if seq <= floor or seq in self._seen:
            return False
        self._seen.add(seq)
        if seq > self.newest:
            self.newest = seq
        if len(self._seen) > 2 * WINDOW:
            floor = self.newest - WINDOW
            self._seen = {s for s in self._seen if s > floor}
        return True


class ReplicaKey:
    """This replica's signing key, and the proof line of what it sends."""

    def __init__(self, replica: str, signing_key: SigningKey | None = None) -> None:
        self.replica = replica
        self.signing_key = signing_key or SigningKey.generate()
        self._curve = self.signing_key.to_curve25519_private_key()
        self._seq = itertools.count()

    @property
    def public_b64(self) -> str:
        return base64.b64encode(bytes(self.signing_key.verify_key)).decode()

    def pair_key(self, verify_key: VerifyKey) -> bytes:
        return Box(self._curve, verify_key.to_curve25519_public_key()).shared_key()

    def seal(self, subject: str, body: bytes, to: str, peer: Peer | None = None) -> bytes:
        """``body`` with its proof: signed for everyone, or MAC'd for ``peer`` (which must be ``to``)."""
        seq, ms = next(self._seq), int(time.time() * 1000)
        covered = _covered(self.replica, to, subject, seq, ms)
        if to == EVERYONE:
            tag = self.signing_key.sign(covered + body).signature
        else:
            assert peer is not None and peer.replica == to
            tag = peer.mac(covered, body)
        return b"%s %s %s %d %d %s\n" % (VERSION, self.replica.encode(), to.encode(), seq, ms, _b64(tag)) + body


@dataclass
class Roster:
    """The live replicas' public keys, from the shared database; a peer each, with the pair's key."""

    key: ReplicaKey
    engine: AsyncEngine
    stale_after: float  # --instance-stale-after: a replica whose instance row is older is dead
    peers: dict[str, Peer] = field(default_factory=dict)
    _keys: dict[str, str] = field(default_factory=dict)
    _refreshed_at: float = float("-inf")
    _refreshing: "asyncio.Task[None] | None" = None

    async def publish(self) -> None:
        """Write this replica's public key beside its instance row (the row exists from start)."""
        async with self.engine.begin() as conn:
            await conn.execute(update(coordinator_instances)
                               .where(coordinator_instances.c.id == self.key.replica)
                               .values(fabric_key=self.key.public_b64))

    async def peer(self, replica: str) -> Peer | None:
        """The peer, reading the database again for a replica not known yet (at most once a second)."""
        peer = self.peers.get(replica)
        if peer is None and time.monotonic() - self._refreshed_at >= REFRESH_AT_MOST:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the database is down for now: a stranger stays one
                log.warning("reading the replicas' fabric keys failed", exc_info=True)
            peer = self.peers.get(replica)
        return peer

    async def refresh(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._read())
        await asyncio.shield(self._refreshing)

    async def _read(self) -> None:
        self._refreshed_at = time.monotonic()
        live_since = int(time.time() - self.stale_after)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(
                select(coordinator_instances.c.id, coordinator_instances.c.fabric_key)
                .where(coordinator_instances.c.fabric_key.is_not(None),
                       coordinator_instances.c.last_seen >= live_since))).all()
        keys = {replica: key for replica, key in rows if replica != self.key.replica}
        peers: dict[str, Peer] = {}
        for replica, key in keys.items():
            known = self.peers.get(replica)
            if known is not None and self._keys.get(replica) == key:
                peers[replica] = known
                continue
            try:
                verify_key = VerifyKey(base64.b64decode(key, validate=True))
                peers[replica] = Peer(replica, verify_key, self.key.pair_key(verify_key))
            except (ValueError, CryptoError, TypeError):
                log.warning("replica %s registered an unusable fabric key: ignored", replica)
        self.peers, self._keys = peers, keys

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the database is down for now: keep the keys we have
                log.warning("reading the replicas' fabric keys failed", exc_info=True)


class Authenticator:
    """Seals what this replica sends and opens what it receives (``Opened``, or ``Rejected``)."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self.me = roster.key.replica
        self.since_ms = int(time.time() * 1000)  # this process started: nothing sent before was for it
        self._windows: dict[str, ReplayWindow] = {}

    def seal(self, subject: str, body: bytes, to: str = EVERYONE) -> bytes | None:
        """None when ``to`` is a replica whose key this one does not have (it cannot read the message)."""
        if to == EVERYONE:
            return self.roster.key.seal(subject, body, to)
        peer = self.roster.peers.get(to)
        return None if peer is None else self.roster.key.seal(subject, body, to, peer)

    async def open(self, subject: str, data: bytes) -> Opened:
        try:
            return await self._open(subject, data)
        except Rejected as rejected:
            DROPPED.labels(rejected.reason).inc()
            raise

    async def _open(self, subject: str, data: bytes) -> Opened:
        line, newline, body = data.partition(b"\n")
        parts = line.split(b" ")
        if not newline or len(line) > MAX_LINE or len(parts) != 6 or parts[0] != VERSION:
            raise Rejected("unauthenticated")
        try:
            sender, to = parts[1].decode("ascii"), parts[2].decode("ascii")
            seq, ms, tag = int(parts[3]), int(parts[4]), _unb64(parts[5])
        except (ValueError, UnicodeDecodeError, binascii.Error):
            raise Rejected("unauthenticated") from None
        if to not in (EVERYONE, self.me):
            raise Rejected("not_for_us")
        if sender == self.me:
            raise Rejected("own_message")
        peer = await self.roster.peer(sender)
        if peer is None:
            raise Rejected("unknown_replica")
        covered = _covered(sender, to, subject, seq, ms)
        if to == EVERYONE:
            try:
                peer.verify_key.verify(covered + body, tag)
            except (BadSignatureError, ValueError):
                raise Rejected("bad_signature") from None
        elif not hmac.compare_digest(peer.mac(covered, body), tag):
            raise Rejected("bad_signature")
        if abs(time.time() * 1000 - ms) > MAX_SKEW_MS or ms < self.since_ms:
            raise Rejected("stale")
        if not self._windows.setdefault(sender, ReplayWindow()).admit(seq):
            raise Rejected("replayed")
        return Opened(sender, body)
