"""Provider session lifecycle: registration (owner stamped from the device token), heartbeats,
trust, eviction and disconnection."""

from __future__ import annotations

import asyncio
import logging
import time

from darkbloom.coordinator.registry import ProviderSession
from darkbloom.coordinator.services import Services
from darkbloom.coordinator.trust import attestation_trust
from darkbloom.crypto import DecryptionError, new_id, public_key_from_b64, token_hash
from darkbloom.protocol import AttestationResponse, Heartbeat, Register, Registered, dump
from darkbloom.store import devices, machines

log = logging.getLogger("darkbloom.sessions")

MACHINE_SEEN_EVERY = 60.0


async def _owner_of(services: Services, auth_token: str | None) -> tuple[str, str] | None:
    if not auth_token or not auth_token.startswith("dkp-"):
        return None
    async with services.engine.connect() as conn:
        return await devices.token_owner(conn, token_hash(auth_token))


async def open_session(services: Services, registration: Register) -> ProviderSession:
    """Create the session; the owner comes only from the device token, never from the frame."""
    owner = await _owner_of(services, registration.auth_token)
    try:
        public_key = public_key_from_b64(registration.public_key)
    except DecryptionError:
        public_key = None
    session = ProviderSession(
        id=new_id("prov_"), account_id=owner[0] if owner else None, machine_id=owner[1] if owner else None,
        registration=registration, public_key=public_key,  # type: ignore[arg-type]
        trust_level=attestation_trust(registration) if public_key is not None else "none")
    if public_key is None:
        session.untrusted_reason = "no valid X25519 public key"
    return session


async def complete_registration(services: Services, session: ProviderSession) -> None:
    services.registry.add(session)
    session.send(dump(Registered(provider_id=session.id, account_id=session.account_id,
                                 machine_id=session.machine_id, trust_level=session.trust_level)))
    session.online = session.untrusted_reason is None
    await _record_machine(services, session)
    log.info("provider %s registered: account=%s machine=%s models=%s trust=%s private_only=%s",
             session.id, session.account_id, session.machine_id, sorted(session.advertised_models),
             session.trust_level, session.private_only)


async def close_session(services: Services, session: ProviderSession) -> None:
    """Take the session out of routing and fail whatever it was serving. Idempotent."""
    if not services.registry.remove(session):
        return
    for pending in list(session.pending.values()):
        pending.on_provider_gone()
    log.info("provider %s disconnected", session.id)
    await _record_machine(services, session)


async def on_heartbeat(services: Services, session: ProviderSession, frame: Heartbeat) -> None:
    if time.monotonic() - session.machine_seen_at >= MACHINE_SEEN_EVERY:
        await _record_machine(services, session)


def on_attestation_response(_services: Services, _session: ProviderSession, _frame: AttestationResponse) -> None:
    """Challenges arrive with the trust work; an unsolicited answer is ignored."""


def distrust(session: ProviderSession, reason: str) -> None:
    session.untrusted_reason = reason
    session.online = False
    log.warning("provider %s marked untrusted: %s", session.id, reason)


async def _record_machine(services: Services, session: ProviderSession) -> None:
    if session.machine_id is None:
        return
    session.machine_seen_at = time.monotonic()
    try:
        async with services.engine.begin() as conn:
            await machines.record_seen(conn, session.machine_id, models=sorted(session.advertised_models),
                                       trust_level=session.trust_level,
                                       private_only=session.private_only,
                                       name=session.registration.name or None,
                                       identity_key=session.registration.identity_key or None)
    except Exception:  # noqa: BLE001 - bookkeeping must not break the socket
        log.exception("could not record machine %s", session.machine_id)


async def evict_silent(services: Services) -> None:
    """Evict every session that sent nothing for ``heartbeat_timeout`` seconds; runs forever."""
    settings = services.settings
    while True:
        await asyncio.sleep(settings.eviction_interval)
        deadline = time.monotonic() - settings.heartbeat_timeout
        for session in services.registry.silent_since(deadline):
            log.warning("provider %s silent for %.0f s: evicting", session.id, settings.heartbeat_timeout)
            await close_session(services, session)
            session.close(1001)
