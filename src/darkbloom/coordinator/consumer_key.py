"""The coordinator's X25519 key pair that consumers may seal request bodies to (docs/api.md "Sealed
bodies"): stored once in the database so that every replica holds the same one. Opening and sealing
bodies with it is the HTTP edge's (``http/sealed_body.py``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from nacl.public import PrivateKey
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store import stored_settings
from darkbloom.wire.crypto import b64d, b64e

ALGORITHM = "x25519-nacl-box"
_STORED_NAME = "consumer_encryption_key"


@dataclass(frozen=True)
class CoordinatorKey:
    private: PrivateKey

    @property
    def public_key_b64(self) -> str:
        return b64e(bytes(self.private.public_key))

    @property
    def kid(self) -> str:
        return "kid_" + hashlib.sha256(bytes(self.private.public_key)).hexdigest()[:16]

    def public_view(self) -> dict[str, str]:
        return {"kid": self.kid, "public_key": self.public_key_b64, "algorithm": ALGORITHM}


async def load_or_create_key(engine: AsyncEngine) -> CoordinatorKey:
    """The stored key pair, created once; replicas racing to create it all end up with the winner's."""
    async with engine.begin() as conn:
        await stored_settings.add(conn, _STORED_NAME, {"private_key": b64e(bytes(PrivateKey.generate()))})
        stored = await stored_settings.get(conn, _STORED_NAME)
    assert stored is not None
    return CoordinatorKey(PrivateKey(b64d(stored["private_key"])))
