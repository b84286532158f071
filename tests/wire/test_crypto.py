"""NaCl envelopes, reply keys, attestation blobs, private files and tokens (docs/protocol.md "Sealing",
"Registration and trust")."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from nacl.public import Box, PrivateKey, PublicKey

from darkbloom.coordinator.fleet.trust import ATTESTATION_SKEW_SECONDS, attestation_trust
from darkbloom.wire import crypto
from darkbloom.wire.crypto import (
    DecryptionError,
    NodeIdentity,
    ReplyKey,
    Sealer,
    b64d,
    b64e,
    challenge_message,
    constant_time_equal,
    new_id,
    new_token,
    open_envelope,
    public_key_from_b64,
    seal,
    token_hash,
    verify_signature,
    write_private_file,
)
from darkbloom.wire.protocol import Envelope, ModelInfo, Register

NONCE = 24
MAC = 16


def _tamper(ciphertext_b64: str, index: int) -> str:
    raw = bytearray(base64.b64decode(ciphertext_b64))
    raw[index] ^= 0x01
    return b64e(bytes(raw))


def test_seal_open_roundtrip_and_wire_format() -> None:
    recipient = PrivateKey.generate()
    message = b'{"messages": [{"role": "user", "content": "secret"}]}'
    envelope = seal(message, recipient.public_key)
    raw = base64.b64decode(envelope.ciphertext)
    assert len(raw) == NONCE + MAC + len(message)  # base64(24-byte nonce ‖ box)
    assert message not in raw
    assert len(b64d(envelope.ephemeral_public_key)) == 32
    assert open_envelope(envelope, recipient) == message


def test_each_seal_uses_a_fresh_ephemeral_key() -> None:
    recipient = PrivateKey.generate()
    first, second = seal(b"x", recipient.public_key), seal(b"x", recipient.public_key)
    assert first.ephemeral_public_key != second.ephemeral_public_key
    assert first.ciphertext != second.ciphertext


def test_sealer_reuses_its_key_with_fresh_nonces() -> None:
    recipient = PrivateKey.generate()
    sealer = Sealer(recipient.public_key)
    a, b = sealer.seal(b"same"), sealer.seal(b"same")
    assert a.ephemeral_public_key == b.ephemeral_public_key == sealer.ephemeral_public_key
    assert base64.b64decode(a.ciphertext)[:NONCE] != base64.b64decode(b.ciphertext)[:NONCE]
    assert open_envelope(a, recipient) == open_envelope(b, recipient) == b"same"


def test_reply_key_request_and_replies() -> None:
    provider = PrivateKey.generate()
    reply_key = ReplyKey()
    request = reply_key.seal_request(b"request body", provider.public_key)
    assert b64d(request.ephemeral_public_key) == bytes(reply_key.public_key)
    assert open_envelope(request, provider) == b"request body"

    # the provider seals each chunk to the request's ephemeral public key
    chunks = [b"chunk-1", b"chunk-2", b"chunk-3"]
    sealer = Sealer(reply_key.public_key)
    assert [reply_key.open(sealer.seal(c)) for c in chunks] == chunks
    assert reply_key.open(seal(b"from another key", reply_key.public_key)) == b"from another key"


def test_a_request_and_its_replies_take_one_key_agreement_per_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """X25519 is most of sealing's cost: the node opens the request and seals its replies with one box,
    and the coordinator opens the replies with the box it sealed the request with."""
    agreements: list[Box] = []

    def counted(private: PrivateKey, public: PublicKey) -> Box:
        agreements.append(Box(private, public))
        return agreements[-1]

    monkeypatch.setattr(crypto, "Box", counted)
    node = PrivateKey.generate()
    reply_key = ReplyKey(sender=b64e(bytes(node.public_key)))
    request = reply_key.seal_request(b"request body", node.public_key)
    assert len(agreements) == 1

    sealer = Sealer.between(node, request.ephemeral_public_key)
    assert sealer.open(request) == b"request body"
    replies = [sealer.seal(chunk) for chunk in (b"one", b"two", b"three")]
    assert len(agreements) == 2

    assert [reply_key.open(reply) for reply in replies] == [b"one", b"two", b"three"]
    assert len(agreements) == 2


def test_a_sealer_opens_only_what_its_peer_sealed_to_it() -> None:
    node = PrivateKey.generate()
    request = ReplyKey().seal_request(b"for this node", node.public_key)
    stranger = Sealer.between(PrivateKey.generate(), request.ephemeral_public_key)
    with pytest.raises(DecryptionError):
        stranger.open(request)


@pytest.mark.parametrize("index", [0, NONCE, -1])
def test_tampered_ciphertext_raises(index: int) -> None:
    recipient = PrivateKey.generate()
    envelope = seal(b"hello world", recipient.public_key)
    bad = Envelope(ephemeral_public_key=envelope.ephemeral_public_key,
                   ciphertext=_tamper(envelope.ciphertext, index))
    with pytest.raises(DecryptionError):
        open_envelope(bad, recipient)


def test_tampered_reply_chunk_raises() -> None:
    reply_key = ReplyKey()
    envelope = Sealer(reply_key.public_key).seal(b"chunk")
    with pytest.raises(DecryptionError):
        reply_key.open(Envelope(ephemeral_public_key=envelope.ephemeral_public_key,
                                ciphertext=_tamper(envelope.ciphertext, -1)))


def test_wrong_recipient_cannot_open() -> None:
    envelope = seal(b"for someone else", PrivateKey.generate().public_key)
    with pytest.raises(DecryptionError):
        open_envelope(envelope, PrivateKey.generate())


_SOME_KEY = b64e(bytes(PrivateKey.generate().public_key))


@pytest.mark.parametrize("envelope", [
    Envelope(ephemeral_public_key=_SOME_KEY, ciphertext="not base64!!"),
    Envelope(ephemeral_public_key=_SOME_KEY, ciphertext=b64e(b"short")),
    Envelope(ephemeral_public_key=_SOME_KEY, ciphertext=b64e(bytes(64))),
    Envelope(ephemeral_public_key=b64e(bytes(32)), ciphertext=b64e(bytes(64))),  # low-order point
    Envelope(ephemeral_public_key=b64e(b"\x01" + bytes(31)), ciphertext=b64e(bytes(64))),  # low-order point
    Envelope(ephemeral_public_key="???", ciphertext=b64e(bytes(64))),
    Envelope(ephemeral_public_key=b64e(bytes(31)), ciphertext=b64e(bytes(64))),
    Envelope(ephemeral_public_key="é", ciphertext=b64e(bytes(64))),
])
def test_garbage_envelopes_raise_decryption_error(envelope: Envelope) -> None:
    with pytest.raises(DecryptionError):
        open_envelope(envelope, PrivateKey.generate())
    with pytest.raises(DecryptionError):
        ReplyKey().open(envelope)


@pytest.mark.parametrize("raw", [bytes(32), b"\x01" + bytes(31)], ids=["zero", "one"])
def test_low_order_public_keys_are_refused(raw: bytes) -> None:
    """An all-zero shared secret would make every later box call fail with a library error."""
    with pytest.raises(DecryptionError):
        public_key_from_b64(b64e(raw))
    assert bytes(public_key_from_b64(_SOME_KEY)) == b64d(_SOME_KEY)


def _register(identity: NodeIdentity, attestation: str, runtime_hash: str = "sha256:abc",
              public_key: str | None = None) -> Register:
    return Register(models=[ModelInfo(id="m")], runtime_hash=runtime_hash,
                    public_key=public_key or identity.public_key_b64,
                    identity_key=identity.identity_key_b64, attestation=attestation)


def test_attestation_verifies() -> None:
    identity = NodeIdentity.generate()
    now = 1_800_000_000
    registration = _register(identity, identity.attestation("sha256:abc", now=now))
    assert attestation_trust(registration, now=now) == "self_signed"
    assert attestation_trust(registration, now=now + ATTESTATION_SKEW_SECONDS) == "self_signed"
    assert attestation_trust(registration, now=now - ATTESTATION_SKEW_SECONDS) == "self_signed"


def test_attestation_with_the_current_clock() -> None:
    identity = NodeIdentity.generate()
    assert attestation_trust(_register(identity, identity.attestation("sha256:abc"))) == "self_signed"


def test_tampered_attestations_do_not_verify() -> None:
    identity, stranger = NodeIdentity.generate(), NodeIdentity.generate()
    now = 1_800_000_000
    good = identity.attestation("sha256:abc", now=now)
    blob = json.loads(b64d(good))

    # a different runtime hash or encryption key than the one signed
    assert attestation_trust(_register(identity, good, runtime_hash="sha256:other"), now=now) == "none"
    assert attestation_trust(_register(identity, good, public_key=stranger.public_key_b64), now=now) == "none"
    # a body edited after signing
    edited = json.loads(blob["body"])
    edited["runtime_hash"] = "sha256:evil"
    forged_body = json.dumps(edited, sort_keys=True, separators=(",", ":"))
    forged = b64e(json.dumps({"body": forged_body, "signature": blob["signature"]}).encode())
    assert attestation_trust(_register(identity, forged, runtime_hash="sha256:evil"), now=now) == "none"
    # a flipped bit in the signature
    sig = bytearray(b64d(blob["signature"]))
    sig[0] ^= 1
    flipped = b64e(json.dumps({"body": blob["body"], "signature": b64e(bytes(sig))}).encode())
    assert attestation_trust(_register(identity, flipped), now=now) == "none"
    # signed by another identity key
    other = stranger.attestation("sha256:abc", now=now)
    assert attestation_trust(_register(identity, other), now=now) == "none"
    # too old or from the future
    assert attestation_trust(_register(identity, good), now=now + ATTESTATION_SKEW_SECONDS + 1) == "none"
    assert attestation_trust(_register(identity, good), now=now - ATTESTATION_SKEW_SECONDS - 1) == "none"


@pytest.mark.parametrize("attestation", ["", "not base64", b64e(b"not json"), b64e(b"[]"),
                                         b64e(b'{"body": 5}'), b64e(b'{"signature": "x"}'),
                                         b64e(b'{"body": "{}", "signature": "x"}'),
                                         b64e(b'{"body": "[]", "signature": "x"}')])
def test_garbage_attestations_are_none(attestation: str) -> None:
    identity = NodeIdentity.generate()
    assert attestation_trust(_register(identity, attestation), now=1_800_000_000) == "none"


def test_signatures_and_challenge_messages() -> None:
    identity = NodeIdentity.generate()
    nonce = b64e(os.urandom(32))
    message = challenge_message(nonce, 1_800_000_000, "sha256:abc")
    assert message.startswith(b64d(nonce))
    signature = identity.sign(message)
    assert verify_signature(identity.identity_key_b64, message, signature)
    assert not verify_signature(identity.identity_key_b64, challenge_message(nonce, 1_800_000_001, "sha256:abc"),
                                signature)
    assert not verify_signature(identity.identity_key_b64, challenge_message(nonce, 1_800_000_000, "sha256:x"),
                                signature)
    assert not verify_signature(NodeIdentity.generate().identity_key_b64, message, signature)
    assert not verify_signature("garbage", message, signature)
    assert not verify_signature(identity.identity_key_b64, message, "garbage")


def test_write_private_file_is_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "auth_token"
    write_private_file(path, "dkp-secret")
    assert path.read_text() == "dkp-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    path.chmod(0o644)
    write_private_file(path, "dkp-rotated")
    assert path.read_text() == "dkp-rotated"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["auth_token"]  # no temp file left behind


def test_identity_persists_in_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    first = NodeIdentity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = NodeIdentity.load_or_create(path)
    assert second.identity_key_b64 == first.identity_key_b64
    assert second.public_key_b64 == first.public_key_b64
    assert NodeIdentity.generate().identity_key_b64 != first.identity_key_b64


def test_tokens_and_ids() -> None:
    token = new_token("dk-")
    assert token.startswith("dk-")
    assert len(base64.urlsafe_b64decode(token[3:] + "=")) >= 32  # ≥ 32 bytes of entropy
    assert new_token("dk-") != token
    assert token_hash(token) == hashlib.sha256(token.encode()).hexdigest()
    assert len(token_hash(token)) == 64
    assert new_id("acct_").startswith("acct_") and new_id("acct_") != new_id("acct_")
    assert constant_time_equal("abc", "abc") and not constant_time_equal("abc", "abd")
    assert not constant_time_equal("abc", "abcd")
