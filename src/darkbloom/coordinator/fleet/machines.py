"""An account's linked machines: stored records (as the machine book will write them) joined with live
sessions; admin enrollment."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from darkbloom.coordinator.fleet import session_lifecycle
from darkbloom.coordinator.fleet.enrollment import CertificateError, load_or_create_ca
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.services import Services
from darkbloom.coordinator.fleet.trust import effective_trust
from darkbloom.coordinator.identity.auth_cache import machine_subject
from darkbloom.coordinator.identity.auth_invalidation import changing
from darkbloom.store import devices, machines


async def linked_machines(services: Services, account_id: str) -> list[dict[str, Any]]:
    async with services.engine.connect() as conn:
        rows = [services.machine_book.current(row) for row in await machines.list_for(conn, account_id)]
    result = []
    for row in rows:
        live = [s for s in services.registry.for_machine(row["id"]) if s.online]
        session = max(live, key=lambda s: s.connected_at) if live else None
        result.append({
            "id": row["id"],
            "session_id": session.id if session else None,
            "name": row["name"],
            "online": session is not None,
            "models": sorted(session.advertised_models) if session else list(row["models"] or []),
            # what it serves with other weights than the catalog pins: its owner's requests only
            "unverified_models": services.settings.catalog.unverified(
                (m.id, m.weight_hash) for m in session.registration.models) if session else [],
            "trust_level": effective_trust(session) if session else row["trust_level"],
            "private_only": session.private_only if session else bool(row["private_only"]),
            "last_seen": row["last_seen"],
        })
    return result


UNLINK_DRAIN_LIMIT = 600.0


async def unlink_machine(services: Services, account_id: str, machine_id: str) -> None:
    """Unlink and revoke the machine's device token at once. Its sessions stop being anyone's own
    machine and take no new work; each disconnects once its in-flight requests end (those settle
    as paid: the serving session no longer belongs to the caller)."""
    async with changing(services, machine_subject(machine_id)) as conn:  # its device token, everywhere
        if not await machines.unlink(conn, account_id, machine_id):
            raise ApiError(404, "machine_not_found", "No linked machine with this id on your account.")
        await devices.revoke_for_machine(conn, machine_id)
    for session in services.registry.for_machine(machine_id):
        retire(services, session)


def retire(services: Services, session: ProviderSession) -> None:
    """The session's machine was unlinked: nobody's own machine from now on, it takes nothing new
    and closes once idle — closed by the replica that holds it (told so when it is another one)."""
    services.registry.disown(session)
    session.draining = True
    session.link.retire(lambda: services.spawn(_close_when_idle(services, session)))


async def _close_when_idle(services: Services, session: ProviderSession) -> None:
    deadline = time.monotonic() + UNLINK_DRAIN_LIMIT
    while session.inboxes and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    session_lifecycle.close_session(services, session)
    session.close(1000)


def _identity_key(services: Services, row: dict[str, Any]) -> str | None:
    """The key the machine registered with: its newest live session's, on any replica (a session that
    has just registered may not be written yet, here or on the replica that holds it), else the stored
    one with this replica's unwritten marks laid over it."""
    live = [s for s in services.registry.for_machine(row["id"]) if s.registration.identity_key]
    if live:
        return max(live, key=lambda s: s.connected_at).registration.identity_key
    return services.machine_book.current(row)["identity_key"]


async def enroll_machine(services: Services, machine_id: str) -> dict[str, Any]:
    """Grant ``hardware`` trust (docs/protocol.md "Registration and trust"): the enrollment CA certifies the
    Ed25519 identity key the machine registered with; the certificate is stored on the machine and handed to
    its live sessions, and the node presents it at every later registration."""
    async with services.engine.connect() as conn:
        row = await machines.get(conn, machine_id)
    if row is None or row["unlinked_at"] is not None:
        raise ApiError(404, "machine_not_found", "No linked machine with this id.")
    identity_key = _identity_key(services, row)
    if not identity_key:
        raise ApiError(409, "machine_not_registered",
                       f"Machine {machine_id} has never connected to this coordinator, so its identity key is "
                       "unknown. Start its node (darkbloom serve) once, then enroll it.")
    ca = await load_or_create_ca(services.engine)
    try:
        certificate = ca.issue(identity_key, machine_id, services.settings.enrollment_cert_days)
    except CertificateError as exc:
        raise ApiError(409, "invalid_identity_key",
                       f"Machine {machine_id} registered an identity key that cannot be certified: {exc}.") from None
    async with services.engine.begin() as conn:
        await machines.set_certificate(conn, machine_id, certificate)
    for session in services.registry.for_machine(machine_id):
        session_lifecycle.on_enrolled(services, session, certificate, ca)
    return {"machine_id": machine_id, "trust_level": "hardware", "certificate": certificate}
