"""Who is calling: consumer API keys (dk-), console sessions (dks-), device tokens (dkp-), admin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, Request

from darkbloom.wire.openai.errors import ApiError, unauthorized
from darkbloom.coordinator.services import Services, get_services
from darkbloom.wire.crypto import constant_time_equal, token_hash
from darkbloom.store import console_sessions, devices, keys

CallerKind = Literal["api_key", "console_session", "device"]


@dataclass(frozen=True)
class Caller:
    account_id: str
    kind: CallerKind
    key: dict[str, Any] | None = None  # the API key row when kind == "api_key"
    machine_id: str | None = None      # the machine when kind == "device"

    @property
    def key_id(self) -> str | None:
        return self.key["id"] if self.key else None


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def resolve_token(services: Services, token: str) -> Caller | None:
    """Look a token up by its SHA-256 hash; the lookup by hash is the constant-time part."""
    digest = token_hash(token)
    async with services.engine.connect() as conn:
        if token.startswith("dk-") and not token.startswith("dk-local-"):
            row = await keys.by_hash(conn, digest)
            return Caller(row["account_id"], "api_key", key=row) if row else None
        if token.startswith("dks-"):
            account_id = await console_sessions.account_for(conn, digest)
            return Caller(account_id, "console_session") if account_id else None
        if token.startswith("dkp-"):
            owner = await devices.token_owner(conn, digest)
            return Caller(owner[0], "device", machine_id=owner[1]) if owner else None
    return None


async def require_caller(request: Request, services: Services = Depends(get_services)) -> Caller:
    """Any authenticated account: API key, console session or device token."""
    token = bearer_token(request)
    caller = await resolve_token(services, token) if token else None
    if caller is None:
        raise unauthorized()
    request.state.account_id = caller.account_id
    return caller


async def require_account_manager(caller: Caller = Depends(require_caller)) -> Caller:
    """Key management and device approval: a console session or an API key, not a device token."""
    if caller.kind == "device":
        raise ApiError(403, "permission_denied",
                       "A device token cannot manage keys or approve devices; use a console session or an API key.")
    return caller


async def require_admin(request: Request, services: Services = Depends(get_services)) -> None:
    token = bearer_token(request)
    expected = services.settings.admin_token
    if not expected:
        raise ApiError(403, "permission_denied",
                       "The admin API is disabled; start the coordinator with --admin-token.")
    if token is None or not constant_time_equal(token, expected):
        raise unauthorized("Missing or invalid admin token.")
