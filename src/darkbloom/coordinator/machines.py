"""An account's linked machines: stored records joined with live sessions."""

from __future__ import annotations

from typing import Any

from darkbloom.coordinator import sessions
from darkbloom.coordinator.errors import ApiError
from darkbloom.coordinator.services import Services
from darkbloom.store import devices, machines


async def linked_machines(services: Services, account_id: str) -> list[dict[str, Any]]:
    async with services.engine.connect() as conn:
        rows = await machines.list_for(conn, account_id)
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
            "trust_level": session.trust_level if session else row["trust_level"],
            "private_only": session.private_only if session else bool(row["private_only"]),
            "last_seen": row["last_seen"],
        })
    return result


async def unlink_machine(services: Services, account_id: str, machine_id: str) -> None:
    """Unlink, revoke the machine's device token and disconnect its sessions."""
    async with services.engine.begin() as conn:
        if not await machines.unlink(conn, account_id, machine_id):
            raise ApiError(404, "machine_not_found", "No linked machine with this id on your account.")
        await devices.revoke_for_machine(conn, machine_id)
    for session in services.registry.for_machine(machine_id):
        await sessions.close_session(services, session)
        session.close(1000)
