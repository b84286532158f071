"""NaCl envelopes, node identity keys, attestation blobs and token hashing (docs/protocol.md "Sealing",
"Registration and trust").

An envelope is a NaCl box (X25519 + XSalsa20-Poly1305) from a fresh ephemeral key pair
to the recipient's X25519 key; ``ciphertext`` is base64(24-byte nonce ‖ box).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import Box, PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey

from darkbloom.wire.protocol import Envelope


class DecryptionError(ValueError):
    pass


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _decode_public_key(text: str) -> PublicKey:
    try:
        raw = b64d(text)
    except (ValueError, UnicodeEncodeError) as exc:
        raise DecryptionError(f"invalid public key: {exc}") from None
    if len(raw) != 32:
        raise DecryptionError("public key must be 32 bytes")
    return PublicKey(raw)


def box_with(private: PrivateKey, public_b64: str) -> Box:
    """The box between our key and a base64 public key; libsodium refuses low-order points (an
    all-zero shared secret), which is the check ``public_key_from_b64`` makes for keys kept for later."""
    try:
        return Box(private, _decode_public_key(public_b64))
    except CryptoError:
        raise DecryptionError("public key is a low-order point") from None


def public_key_from_b64(text: str) -> PublicKey:
    key = _decode_public_key(text)
    try:
        Box(PrivateKey.generate(), key)  # libsodium refuses low-order points (all-zero shared secret)
    except CryptoError:
        raise DecryptionError("public key is a low-order point") from None
    return key


class Sealer:
    """Seals many messages to one recipient from one ephemeral key (fresh nonce each)."""

    def __init__(self, recipient: PublicKey) -> None:
        self._ephemeral = PrivateKey.generate()
        self._box = Box(self._ephemeral, recipient)
        self.ephemeral_public_key = b64e(bytes(self._ephemeral.public_key))

    @classmethod
    def to(cls, recipient_b64: str) -> "Sealer":
        """A sealer to a base64 key, checked by the one key agreement it needs (DecryptionError)."""
        return cls.between(PrivateKey.generate(), recipient_b64)

    @classmethod
    def between(cls, sender: PrivateKey, recipient_b64: str) -> "Sealer":
        """A sealer from a known key (a node's own, for its chunks: only it can make a chunk that opens
        with its registered key) to a base64 key."""
        sealer = cls.__new__(cls)
        sealer._ephemeral = sender
        sealer._box = box_with(sender, recipient_b64)
        sealer.ephemeral_public_key = b64e(bytes(sender.public_key))
        return sealer

    def seal(self, plaintext: bytes) -> Envelope:
        return Envelope(ephemeral_public_key=self.ephemeral_public_key,
                        ciphertext=b64e(bytes(self._box.encrypt(plaintext))))

    def open(self, envelope: Envelope) -> bytes:
        """Open what the recipient sealed to our key: the box is the same one both ways, so a node
        answering a request opens it and seals every reply with one key agreement."""
        return _open(self._box, envelope.ciphertext)


class ReplyKey:
    """The per-request ephemeral key pair whose public half travels with a sealed request
    and to which every reply is sealed; from ``sender`` only (a base64 key), when given."""

    def __init__(self, sender: str | None = None) -> None:
        self._private = PrivateKey.generate()
        self.public_key = self._private.public_key
        self._boxes: dict[str, Box] = {}
        self.sender = sender

    def prepare(self, recipient: PublicKey) -> "ReplyKey":
        """Make the key agreement with ``recipient`` now, so sealing a request to it later does not."""
        self._boxes[b64e(bytes(recipient))] = Box(self._private, recipient)
        return self

    def seal_request(self, plaintext: bytes, recipient: PublicKey) -> Envelope:
        """Seal to the node's key; its replies come from that key, so the box is kept to open them."""
        name = b64e(bytes(recipient))
        box = self._boxes.get(name)
        if box is None:
            box = self._boxes[name] = Box(self._private, recipient)
        return Envelope(ephemeral_public_key=b64e(bytes(self.public_key)),
                        ciphertext=b64e(bytes(box.encrypt(plaintext))))

    def open(self, envelope: Envelope) -> bytes:
        if self.sender is not None and envelope.ephemeral_public_key != self.sender:
            raise DecryptionError("the chunk is not from the key the request was sealed to")
        box = self._boxes.get(envelope.ephemeral_public_key)
        if box is None:
            box = box_with(self._private, envelope.ephemeral_public_key)
            self._boxes[envelope.ephemeral_public_key] = box
        return _open(box, envelope.ciphertext)


def seal(plaintext: bytes, recipient: PublicKey) -> Envelope:
    return Sealer(recipient).seal(plaintext)


def open_envelope(envelope: Envelope, recipient: PrivateKey) -> bytes:
    return _open(box_with(recipient, envelope.ephemeral_public_key), envelope.ciphertext)


def _open(box: Box, ciphertext_b64: str) -> bytes:
    try:
        return box.decrypt(b64d(ciphertext_b64))
    except (CryptoError, ValueError, UnicodeEncodeError) as exc:
        raise DecryptionError(f"envelope does not open: {exc}") from None


# node identity


@dataclass
class NodeIdentity:
    signing_key: SigningKey
    encryption_key: PrivateKey

    @property
    def identity_key_b64(self) -> str:
        return b64e(bytes(self.signing_key.verify_key))

    @property
    def public_key_b64(self) -> str:
        return b64e(bytes(self.encryption_key.public_key))

    @classmethod
    def generate(cls) -> "NodeIdentity":
        return cls(SigningKey.generate(), PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> "NodeIdentity":
        if path.exists():
            data = json.loads(path.read_text())
            return cls(SigningKey(b64d(data["ed25519_seed"])), PrivateKey(b64d(data["x25519_private"])))
        identity = cls.generate()
        write_private_file(path, json.dumps({
            "ed25519_seed": b64e(bytes(identity.signing_key)),
            "x25519_private": b64e(bytes(identity.encryption_key)),
        }))
        return identity

    def attestation(self, runtime_hash: str, now: int | None = None) -> str:
        """A signed blob binding identity key, encryption key and runtime hash at a time."""
        body = attestation_body(self.identity_key_b64, self.public_key_b64, runtime_hash,
                                int(time.time()) if now is None else now)
        signature = self.signing_key.sign(body).signature
        return b64e(json.dumps({"body": body.decode(), "signature": b64e(signature)}).encode())

    def sign(self, message: bytes) -> str:
        return b64e(self.signing_key.sign(message).signature)


def attestation_body(identity_key: str, public_key: str, runtime_hash: str, timestamp: int) -> bytes:
    return json.dumps(
        {"encryption_key": public_key, "identity_key": identity_key,
         "runtime_hash": runtime_hash, "timestamp": timestamp},
        sort_keys=True, separators=(",", ":"),
    ).encode()


def verify_signature(identity_key_b64: str, message: bytes, signature_b64: str) -> bool:
    try:
        VerifyKey(b64d(identity_key_b64)).verify(message, b64d(signature_b64))
        return True
    except (BadSignatureError, ValueError, UnicodeEncodeError, TypeError):
        return False


def write_private_file(path: Path, text: str) -> None:
    """Write a secret file readable only by its owner (mode 0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


# tokens


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def constant_time_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def challenge_message(nonce_b64: str, timestamp: int, runtime_hash: str) -> bytes:
    """What a node signs to answer an attestation challenge: nonce ‖ timestamp ‖ runtime hash."""
    return b64d(nonce_b64) + str(timestamp).encode() + b"|" + runtime_hash.encode()
