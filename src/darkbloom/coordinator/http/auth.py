"""Who is calling: consumer API keys (dk-), console sessions (dks-), device tokens (dkp-), admin.
Tokens resolve through the process's AuthCache (coordinator/identity/auth_cache.py) to a ``Caller``
(coordinator/identity/caller.py)."""

from __future__ import annotations


from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.identity.api_keys import ApiKey
from darkbloom.coordinator.identity.auth_cache import Grant, key_subject, machine_subject, session_subject
from darkbloom.coordinator.identity.caller import Caller, CallerKind
from darkbloom.coordinator.services import Services, get_services
from darkbloom.wire.openai.errors import ApiError, unauthorized
from darkbloom.wire.openai.handlers import speaks_anthropic
from darkbloom.wire.crypto import constant_time_equal, token_hash
from darkbloom.store import console_sessions, devices, keys


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def resolve_token(services: Services, token: str) -> Caller | None:
    """The caller a token stands for: from memory when this process has seen the token lately,
    else looked up by its SHA-256 hash (the lookup by hash is the constant-time part)."""
    kind = _token_kind(token)
    if kind is None:
        return None
    digest = token_hash(token)
    grant = await services.auth_cache.get(digest, lambda: _load_grant(services.engine, kind, digest))
    return grant.value if grant is not None else None


def _token_kind(token: str) -> CallerKind | None:
    if token.startswith("dk-") and not token.startswith("dk-local-"):
        return "api_key"
    if token.startswith("dks-"):
        return "console_session"
    if token.startswith("dkp-"):
        return "device"
    return None


async def _load_grant(engine: AsyncEngine, kind: CallerKind, digest: str) -> Grant | None:
    async with engine.connect() as conn:
        if kind == "api_key":
            row = await keys.by_hash(conn, digest)
            return Grant(Caller(row["account_id"], "api_key", key=ApiKey.from_row(row)),
                         (key_subject(row["id"]),)) if row else None
        if kind == "console_session":
            session = await console_sessions.session_for(conn, digest)
            return Grant(Caller(session[0], "console_session"), (session_subject(digest),),
                         expires_at=session[1]) if session else None
        owner = await devices.token_owner(conn, digest)
        return Grant(Caller(owner[0], "device", machine_id=owner[1]),
                     (machine_subject(owner[1]),)) if owner else None


async def require_caller(request: Request, services: Services = Depends(get_services)) -> Caller:
    """Any authenticated account: API key, console session or device token."""
    token = bearer_token(request)
    anthropic = speaks_anthropic(request.scope["path"])  # its key may come as `x-api-key` (docs/api.md "Authentication")
    if token is None and anthropic:
        token = request.headers.get("x-api-key", "").strip() or None
    caller = await resolve_token(services, token) if token else None
    if caller is None:
        raise unauthorized("Missing or invalid API key. Pass it as 'x-api-key: dk-…' (or 'Authorization: Bearer "
                           "dk-…').") if anthropic else unauthorized()
    refusal = caller.key.refusal() if caller.key is not None else None
    if refusal is not None:
        raise refusal
    request.state.account_id = caller.account_id
    return caller




async def require_account_writer(caller: Caller = Depends(require_caller)) -> Caller:
    """Account writes (keys, device approval, unlinking): a console session or an unrestricted API
    key. Device tokens may do inference and account reads only (docs/api.md "Who may change the account")."""
    if caller.kind == "device":
        raise ApiError(403, "forbidden", "A device token can run inference and read the account, not change it; "
                                         "use a console session or an unrestricted API key.")
    if caller.key is not None and caller.key.restricted:
        raise ApiError(403, "key_restricted", "This API key is restricted (self-route only, a spend limit, an "
                                              "expiry, allowed models, rate limits or a share price ceiling), so "
                                              "it cannot manage keys or "
                                              "machines; use a console session or an unrestricted API key.")
    return caller


async def require_admin(request: Request, services: Services = Depends(get_services)) -> None:
    token = bearer_token(request)
    expected = services.settings.admin_token
    if not expected:
        raise ApiError(403, "permission_denied",
                       "The admin API is disabled; start the coordinator with --admin-token.")
    if token is None or not constant_time_equal(token, expected):
        raise unauthorized("Missing or invalid admin token.")
