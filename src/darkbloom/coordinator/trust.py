"""Trust levels from what a node proves at registration (CONTRACT §7)."""

from __future__ import annotations

import json
import time

from darkbloom.crypto import attestation_body, b64d, verify_signature
from darkbloom.protocol import Register

ATTESTATION_SKEW_SECONDS = 120


def attestation_trust(registration: Register, now: float | None = None) -> str:
    """``self_signed`` when the attestation blob verifies under the node's identity key, else ``none``."""
    try:
        blob = json.loads(b64d(registration.attestation))
        body = blob["body"].encode()
        fields = json.loads(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        return "none"
    now = time.time() if now is None else now
    expected = attestation_body(registration.identity_key, registration.public_key, registration.runtime_hash,
                                int(fields.get("timestamp", 0)) if isinstance(fields, dict) else 0)
    if body != expected or abs(now - fields["timestamp"]) > ATTESTATION_SKEW_SECONDS:
        return "none"
    return "self_signed" if verify_signature(registration.identity_key, body, blob.get("signature", "")) else "none"
