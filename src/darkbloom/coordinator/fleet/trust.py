"""Trust (docs/protocol.md "Registration and trust"): what a node proves at registration and keeps proving
through challenges.

Everything here is a pure function of a registration, a session, the settings and a clock; the
connection that sends challenges and applies the results is ``fleet/connection.py``.

- ``trust_level`` of a session is what it proved at registration: ``none`` < ``self_signed``
  (the attestation blob verifies under its Ed25519 identity key) < ``hardware`` (additionally a
  certificate from the coordinator's enrollment CA for that identity key). It never goes down.
- ``untrusted_reason`` is set once a session fails a check (challenge answer, missed deadline,
  changed runtime hash, a chunk that does not open); from then on it is never routable. APIs show
  such a session's trust as ``untrusted`` (``ProviderSession.effective_trust``).
- ``runtime_verified``: the registered runtime hash is in the coordinator's allow-list.
- ``challenge_passed_at``: monotonic time of the last passed challenge; ``challenge_fresh`` says
  whether it is recent enough to route to.
"""

from __future__ import annotations

import json
import os
import time

from darkbloom.coordinator.config import TRUST_LEVELS, CoordinatorSettings
from darkbloom.coordinator.fleet.enrollment import EnrollmentCA
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.wire.crypto import attestation_body, b64d, b64e, challenge_message, verify_signature
from darkbloom.wire.protocol import AttestationChallenge, AttestationResponse, Register

ATTESTATION_SKEW_SECONDS = 120
CHALLENGE_NONCE_BYTES = 32
_RANK = {level: rank for rank, level in enumerate(TRUST_LEVELS)}


def attestation_trust(registration: Register, now: float | None = None) -> str:
    """``self_signed`` when the attestation blob verifies under the node's identity key, else ``none``."""
    try:
        blob = json.loads(b64d(registration.attestation))
        body = blob["body"].encode()
        fields = json.loads(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        return "none"
    if not isinstance(fields, dict) or not isinstance(fields.get("timestamp"), int):
        return "none"
    now = time.time() if now is None else now
    expected = attestation_body(registration.identity_key, registration.public_key, registration.runtime_hash,
                                fields["timestamp"])
    if body != expected or abs(now - fields["timestamp"]) > ATTESTATION_SKEW_SECONDS:
        return "none"
    signature = blob.get("signature", "")
    return "self_signed" if verify_signature(registration.identity_key, body, signature) else "none"


def certificate_problem(registration: Register, ca: EnrollmentCA | None, now: float | None = None) -> str | None:
    """Why the registration's certificate does not prove ``hardware``, or None when it does."""
    if not registration.certificate:
        return "no certificate presented"
    if ca is None:
        return "this coordinator has not enrolled any machine yet (no enrollment CA)"
    return ca.verify(registration.certificate, registration.identity_key, now)


def registration_trust(registration: Register, ca: EnrollmentCA | None, now: float | None = None) -> str:
    """The level a registration proves: ``hardware`` needs a valid attestation *and* a certificate
    from ``ca`` for the registration's identity key; a certificate never lifts a bad attestation."""
    level = attestation_trust(registration, now)
    if level == "self_signed" and certificate_problem(registration, ca, now) is None:
        return "hardware"
    return level


def runtime_allowed(settings: CoordinatorSettings, runtime_hash: str) -> bool:
    return bool(runtime_hash) and runtime_hash in settings.runtime_allow_list


def trust_at_least(level: str, floor: str) -> bool:
    """``level`` ≥ ``floor`` in ``none`` < ``self_signed`` < ``hardware``; ``untrusted`` meets nothing."""
    return level in _RANK and _RANK[level] >= _RANK[floor]


def challenge_fresh(session: ProviderSession, settings: CoordinatorSettings, now: float | None = None) -> bool:
    """The session's last passed challenge is at most ``challenge_freshness`` seconds old
    (``now`` on the ``time.monotonic()`` clock). Says nothing about ``untrusted_reason``."""
    passed = session.challenge_passed_at
    if passed is None:
        return False
    now = time.monotonic() if now is None else now
    return now - passed <= settings.challenge_freshness


def new_challenge(now: float | None = None) -> AttestationChallenge:
    return AttestationChallenge(nonce=b64e(os.urandom(CHALLENGE_NONCE_BYTES)),
                                timestamp=int(time.time() if now is None else now))


def challenge_failure(challenge: AttestationChallenge, answer: AttestationResponse,
                      registration: Register) -> str | None:
    """Why ``answer`` does not pass ``challenge`` for this registration, or None when it passes.

    It must be for this nonce, report the registered runtime hash, and carry an Ed25519 signature
    by the registered identity key over ``challenge_message(nonce, timestamp, runtime_hash)``."""
    if answer.nonce != challenge.nonce:
        return "the attestation response answers a different challenge"
    if answer.runtime_hash != registration.runtime_hash:
        return "the runtime hash changed since registration"
    message = challenge_message(challenge.nonce, challenge.timestamp, registration.runtime_hash)
    if not registration.identity_key or not verify_signature(registration.identity_key, message, answer.signature):
        return "the attestation response signature does not verify under the registered identity key"
    return None
