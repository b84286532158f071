"""Device login (RFC 8628 shape; docs/api.md "Device login"): a node gets a device token for an account,
which links its machine to the account; unlinking the machine revokes the token."""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

from pydantic import Field, with_config
from typing_extensions import TypedDict

from darkbloom.coordinator.errors import machine_not_found
from darkbloom.coordinator.identity.auth_cache import machine_subject
from darkbloom.coordinator.identity.auth_invalidation import changing
from darkbloom.wire.openai.body_schema import OPEN, BodySchema
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import new_token, token_hash
from darkbloom.store import devices, machines

USER_CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"


def _user_code() -> str:
    raw = "".join(secrets.choice(USER_CODE_ALPHABET) for _ in range(8))
    return f"{raw[:4]}-{raw[4:]}"


async def start(services: Services) -> dict[str, Any]:
    settings = services.settings
    device_code = secrets.token_urlsafe(32)
    user_code = _user_code()
    async with services.engine.begin() as conn:
        await devices.create_code(conn, token_hash(device_code), user_code, settings.device_code_ttl)
    link = f"{settings.base_url}/console/link"
    return {"device_code": device_code, "user_code": user_code, "verification_uri": link,
            "verification_uri_complete": f"{link}?code={user_code}",
            "expires_in": settings.device_code_ttl, "interval": settings.device_poll_interval}


@with_config(OPEN)
class DeviceApproval(TypedDict):
    user_code: Annotated[str, Field(pattern=r"\S", examples=["ABCD-EFGH"])]


@with_config(OPEN)
class DeviceTokenRequest(TypedDict):
    device_code: Annotated[str, Field(min_length=1)]


DEVICE_APPROVAL = BodySchema(DeviceApproval, {
    "user_code": "'user_code' is required: the XXXX-XXXX code `darkbloom login` printed."})
DEVICE_TOKEN_REQUEST = BodySchema(DeviceTokenRequest, {"device_code": "'device_code' is required."})


async def approve(services: Services, account_id: str, user_code: str) -> None:
    code = user_code.strip().upper()
    async with services.engine.begin() as conn:
        row = await devices.by_user_code(conn, code)
        if row is None:
            raise ApiError(404, "invalid_code", "This code is not valid. Check it against what `darkbloom login` printed.")
        if row["status"] != "pending":
            raise ApiError(409, "already_used", "This code was already used. Run `darkbloom login` again for a new one.")
        if row["expires_at"] <= time.time():
            raise ApiError(410, "expired_code", "This code has expired. Run `darkbloom login` again for a new one.")
        if not await devices.approve(conn, code, account_id):
            raise ApiError(409, "already_used", "This code was already used. Run `darkbloom login` again for a new one.")


async def exchange(services: Services, device_code: str) -> dict[str, Any]:
    """Poll for the token: pending, or the device token exactly once (a new linked machine)."""
    async with services.engine.begin() as conn:
        row = await devices.by_device_code(conn, token_hash(device_code))
        if row is None or row["status"] == "issued":
            raise ApiError(404, "invalid_grant", "Unknown or already used device code. Run `darkbloom login` again.")
        if row["status"] == "pending":
            if row["expires_at"] <= time.time():
                raise ApiError(410, "expired_token", "The login code expired before it was approved. "
                                                     "Run `darkbloom login` again.")
            return {"status": "authorization_pending"}
        if not await devices.mark_issued(conn, row["device_code_hash"]):
            raise ApiError(404, "invalid_grant", "Unknown or already used device code. Run `darkbloom login` again.")
        account_id = row["account_id"]
        token = new_token("dkp-")
        machine_id = await machines.create(conn, account_id, name="machine " + row["user_code"])
        await devices.create_token(conn, token_hash(token), machine_id, account_id)
    return {"status": "authorized", "token": token, "account_id": account_id, "machine_id": machine_id}


async def unlink_machine(services: Services, account_id: str, machine_id: str) -> None:
    """Unlink the machine and revoke its device token at once (every coordinator's cache drops it). Its
    sessions are retired: nobody's own machine from now on, they take no new work and disconnect once
    their in-flight requests end (those settle as paid: the serving session no longer belongs to the caller)."""
    async with changing(services, machine_subject(machine_id)) as conn:
        if not await machines.unlink(conn, account_id, machine_id):
            raise machine_not_found()
        await devices.revoke_for_machine(conn, machine_id)
    for session in services.registry.for_machine(machine_id):
        session.retire()
