"""Shares (docs/sharing.md): what an owner may write into one, and how one is shown to its owner
and to its grantee. Routing over shared machines and their daily limits live with the rest of
routing and money; this is the account-side object."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from darkbloom.coordinator.errors import machine_not_found
from darkbloom.wire.openai.errors import ApiError, invalid_request

SHARE_FIELDS = ("email", "machines", "daily_request_limit", "daily_token_limit", "input_price", "output_price",
                "expires_at")
CHANGEABLE_FIELDS = SHARE_FIELDS[1:]                       # PATCH: all but the email
SHOWN_TERMS = ("machines", "input_price", "output_price")  # what an answer may say it was shown
MAX_MACHINES = 1000
MAX_PRICE = 10**12          # µUSD per 1M tokens: a million dollars per million tokens
MAX_DAILY_LIMIT = 2**53     # exact in every JSON client
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
_MACHINE_ID = re.compile(r"^mach_[A-Za-z0-9_-]{1,120}$")


def share_not_found() -> ApiError:
    """One answer for a share that does not exist and one that is not the caller's."""
    return ApiError(404, "share_not_found", "No such share among the shares you gave or received.")


def email_not_verified() -> ApiError:
    return ApiError(403, "email_not_verified",
                    "Verify your email address before you accept a share sent to it: POST /v1/me/email/send-code, "
                    "then POST /v1/me/email/verify with the code you receive — or ask the owner for the share's "
                    "invite code (POST /v1/shares/accept).")


def _refuse_unknown(body: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = [name[:64] for name in body if name not in allowed]
    if unknown:
        raise invalid_request(f"Unknown {what} field(s): {', '.join(repr(u) for u in unknown[:5])}. "
                              f"It takes {', '.join(allowed)}.", param=unknown[0])


def share_fields(body: dict[str, Any], *, owner_email: str | None, now: float) -> dict[str, Any]:
    """Store columns from a POST /v1/shares body; every bad value and unknown field is a named 400."""
    _refuse_unknown(body, SHARE_FIELDS, "share")
    email = body.get("email")
    if not isinstance(email, str) or len(email) > 320 or not _EMAIL.match(email.strip()):
        raise invalid_request("'email' must be the email address of the person you share with.", param="email")
    email = email.strip().lower()
    if owner_email is not None and email == owner_email:
        raise invalid_request("You cannot share machines with yourself: your own machines already serve you "
                              "(X-Darkbloom-Route: self).", param="email")
    defaults = {"machines": None, "daily_request_limit": None, "daily_token_limit": None, "input_price": 0,
                "output_price": 0, "expires_at": None}
    return {"grantee_email": email, **_columns({**defaults, **body}, now)}


def share_changes(body: dict[str, Any], *, now: float) -> dict[str, Any]:
    """Store columns for the fields a PATCH /v1/shares/{id} body names (the email never changes: a
    share for someone else is a new share)."""
    _refuse_unknown(body, CHANGEABLE_FIELDS, "share")
    return _columns(body, now)


def shown_terms(body: dict[str, Any]) -> dict[str, Any]:
    """The terms an accept or decline says its grantee was shown (each optional): the share's
    columns they must still equal."""
    _refuse_unknown(body, SHOWN_TERMS, "accept")
    return _columns(body, now=0)


def _columns(body: dict[str, Any], now: float) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if "machines" in body:
        fields["machine_ids"] = None if body["machines"] == "all" else _machines(body["machines"])
    for name in ("daily_request_limit", "daily_token_limit"):
        if name in body:
            fields[name] = _whole(body[name], name, low=1, high=MAX_DAILY_LIMIT, nullable=True)
    for name in ("input_price", "output_price"):
        if name in body:
            fields[name] = _whole(body[name], name, low=0, high=MAX_PRICE, nullable=False)
    if "expires_at" in body:
        fields["expires_at"] = _expiry(body["expires_at"], now)
    return fields


def _machines(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > MAX_MACHINES:
        raise invalid_request(f"'machines' must be a non-empty list of up to {MAX_MACHINES} machine ids "
                              "(mach_…), or left out for all your machines.", param="machines")
    for item in value:
        if not isinstance(item, str):
            raise invalid_request("'machines' must list machine ids (mach_…).", param="machines")
        if not _MACHINE_ID.match(item):
            raise machine_not_found()
    return sorted(set(value))


def _whole(value: Any, name: str, *, low: int, high: int, nullable: bool) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        extra = " or null" if nullable else ""
        raise invalid_request(f"'{name}' must be an integer from {low} to {high}{extra}.", param=name)
    return value


def _expiry(value: Any, now: float) -> int | None:
    if value is None:
        return None
    try:
        if not isinstance(value, str) or len(value) > 64:
            raise ValueError
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise invalid_request("'expires_at' must be an ISO-8601 time such as 2027-01-31T00:00:00Z.",
                              param="expires_at") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)  # a time without a zone is UTC, as everywhere here
    expires_at = int(moment.timestamp())
    if expires_at <= now:
        raise invalid_request("'expires_at' is in the past.", param="expires_at")
    return expires_at


def iso(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def share_view(row: dict[str, Any], *, machine_names: dict[str, str] | None = None) -> dict[str, Any]:
    """The share as its owner sees it; a received one (``machine_names`` given) also names the owner
    and the machines it covers."""
    view: dict[str, Any] = {
        "id": row["id"], "object": "share", "grantee_email": row["grantee_email"],
        "machines": row["machine_ids"] if row["machine_ids"] is not None else "all",
        "daily_request_limit": row["daily_request_limit"], "daily_token_limit": row["daily_token_limit"],
        "input_price": int(row["input_price"]), "output_price": int(row["output_price"]),
        "expires_at": iso(row["expires_at"]), "created_at": row["created_at"], "status": row["status"],
    }
    if machine_names is not None:
        view["owner_email"] = row["owner_email"]
        ids = row["machine_ids"] if row["machine_ids"] is not None else sorted(machine_names)
        view["machine_names"] = {mid: machine_names[mid] for mid in ids if mid in machine_names}
    return view
