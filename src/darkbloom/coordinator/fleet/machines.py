"""An account's linked machines: stored records (as the machine book will write them) joined with live
sessions; their stats; admin enrollment. (Linking and unlinking are identity's: ``identity/device_login.py``.)"""

from __future__ import annotations

import time
from typing import Any

from darkbloom.coordinator.errors import machine_not_found
from darkbloom.coordinator.fleet.enrollment import CertificateError, load_or_create_ca
from darkbloom.coordinator.fleet.insight import KEPT_HOURS, PASSED_OVER_REASONS, hour_of, tps_of_bucket
from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.coordinator.services import Services
from darkbloom.store import insight, machines


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
            "trust_level": session.effective_trust if session else row["trust_level"],
            "private_only": session.private_only if session else bool(row["private_only"]),
            # where and with what it runs its models (cpu, metal, cuda, …; llama-cpp, openai): known while online
            "device": session.registration.hardware.device if session else None,
            "backend": session.registration.hardware.backend if session else None,
            "last_seen": row["last_seen"],
        })
    return result


def _identity_key(services: Services, row: dict[str, Any]) -> str | None:
    """The key the machine registered with: its newest live session's, on any replica (a session that
    has just registered may not be written yet, here or on the replica that holds it), else the stored
    one with this replica's unwritten marks laid over it."""
    live = [s for s in services.registry.for_machine(row["id"]) if s.registration.identity_key]
    if live:
        return max(live, key=lambda s: s.connected_at).registration.identity_key
    stored: str | None = services.machine_book.current(row)["identity_key"]
    return stored


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
        session.enrolled(certificate, ca)
    return {"machine_id": machine_id, "trust_level": "hardware", "certificate": certificate}


MAX_STATS_HOURS = KEPT_HOURS  # what the machine insight keeps


async def machine_stats(services: Services, account_id: str, machine_id: str, hours: int) -> dict[str, Any]:
    """What the owner's machine did over the last ``hours`` hours (docs/api.md "Machine stats"): its
    usage rows by route and hour, and the insight counters every replica adds to (this replica's are
    written first, with the machine's time so far, so its own counts are current; another's are at most
    ``insight_interval`` late, and a machine's idle time there at most ``MachineInsight.IDLE_COUNT``)."""
    if not 1 <= hours <= MAX_STATS_HOURS:
        raise invalid_request(f"'hours' must be a whole number from 1 to {MAX_STATS_HOURS}.", param="hours")
    async with services.engine.connect() as conn:
        row = await machines.get(conn, machine_id)
    if row is None or row["account_id"] != account_id or row["unlinked_at"] is not None:
        raise machine_not_found()
    await services.insight.flush(machine_id=machine_id)
    first = hour_of(time.time()) - (hours - 1) * 3600
    async with services.engine.connect() as conn:
        by_hour = await insight.machine_hours(conn, machine_id, first)
        counters = await insight.counters(conn, machine_id, first)
    hourly = {first + 3600 * i: {"owned": 0, "shared": 0, "fleet": 0} for i in range(hours)}
    requests = {"owned": 0, "shared": 0, "fleet": 0}
    prompt = completion = earnings = 0
    for r in by_hour:
        routed = r["routed"] if r["routed"] in requests else "fleet"
        requests[routed] += int(r["requests"])
        if int(r["hour"]) in hourly:
            hourly[int(r["hour"])][routed] += int(r["requests"])
        prompt += int(r["prompt_tokens"] or 0)
        completion += int(r["completion_tokens"] or 0)
        earnings += int(r["payout"] or 0)
    busy, total = counters.get("busy_slot_ms", 0), counters.get("slot_ms", 0)
    return {
        "hours": hours, "requests": {**requests}, "prompt_tokens": prompt, "completion_tokens": completion,
        "earnings_micro_usd": earnings,
        "busy_fraction": round(busy / total, 4) if total else None,
        "decode_tps_p50": _median_tps({int(name[len("tps_ms:"):]): n for name, n in counters.items()
                                       if name.startswith("tps_ms:")}),
        "passed_over": {reason: counters.get(f"passed_over:{reason}", 0) for reason in PASSED_OVER_REASONS},
        "hourly": [{"hour": hour, **counts} for hour, counts in hourly.items()],
    }


def _median_tps(buckets: dict[int, int]) -> float | None:
    """The bucket (as its decode speed) the machine spent the middle millisecond of its measured time in,
    or None before it was measured."""
    total = sum(buckets.values())
    seen = 0
    for bucket in sorted(buckets):
        seen += buckets[bucket]
        if 2 * seen >= total and total:
            return tps_of_bucket(bucket)
    return None
