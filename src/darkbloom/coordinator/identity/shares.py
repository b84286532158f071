"""Shares (docs/sharing.md): what an owner may write into one, and how one is shown to its owner
and to its grantee. Routing over shared machines and their daily limits live with the rest of
routing and money; this is the account-side object."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import Field, with_config
from typing_extensions import Required, TypedDict

from darkbloom.coordinator.errors import machine_not_found
from darkbloom.wire.openai.body_schema import CLOSED, OPEN, BodySchema, Refusal, Refusals
from darkbloom.wire.openai.errors import ApiError, invalid_request

MAX_MACHINES = 1000
MAX_PRICE = 10**12          # µUSD per 1M tokens: a million dollars per million tokens
MAX_DAILY_LIMIT = 2**53     # exact in every JSON client
_MACHINE_ID = re.compile(r"^mach_[A-Za-z0-9_-]{1,120}$")


def share_not_found() -> ApiError:
    """One answer for a share that does not exist and one that is not the caller's."""
    return ApiError(404, "share_not_found", "No such share among the shares you gave or received.")


def email_not_verified() -> ApiError:
    return ApiError(403, "email_not_verified",
                    "Verify your email address before you accept a share sent to it: POST /v1/me/email/send-code, "
                    "then POST /v1/me/email/verify with the code you receive — or ask the owner for the share's "
                    "invite code (POST /v1/shares/accept).")


Price = Annotated[int, Field(ge=0, le=MAX_PRICE)]
DailyLimit = Annotated[int, Field(ge=1, le=MAX_DAILY_LIMIT)]


@with_config(CLOSED)
class ShareAnswer(TypedDict, total=False):
    """Optionally the terms you were shown: a share whose terms differ now is not answered (409)."""

    machines: Annotated[Literal["all"] | Annotated[list[str], Field(min_length=1, max_length=MAX_MACHINES)] | None,
                        Field(description="Left out (or null, or \"all\"): all your machines, present and future.")]
    input_price: Annotated[Price, Field(description="µUSD per 1M prompt tokens; 0 with output_price 0: free.")]
    output_price: Price


@with_config(CLOSED)
class ShareUpdate(ShareAnswer, total=False):
    """New prices or machines put the share back to pending until its grantee accepts them."""

    daily_request_limit: DailyLimit | None
    daily_token_limit: DailyLimit | None
    expires_at: Annotated[Annotated[str, Field(max_length=64)] | None, Field(json_schema_extra={"format": "date-time"})]


@with_config(CLOSED)
class ShareCreate(ShareUpdate, total=False):
    email: Required[Annotated[str, Field(max_length=320, pattern=r"^\s*[^@\s]+@[^@\s]+\.[^@\s]+\s*$",
                                         json_schema_extra={"format": "email"})]]


@with_config(OPEN)
class ShareInvite(TypedDict):
    invite_code: Annotated[str, Field(pattern=r"\S", max_length=256)]


SHARE_INVITE = BodySchema(ShareInvite, {"invite_code": "'invite_code' must be the invite code the share's owner "
                                                      "gave you."})


def _whole(name: str, low: int, high: int, nullable: bool) -> str:
    return f"'{name}' must be an integer from {low} to {high}{' or null' if nullable else ''}."


_EXPIRY = "'expires_at' must be an ISO-8601 time such as 2027-01-31T00:00:00Z."
_NAMED_400S: Refusals = {
    "email": "'email' must be the email address of the person you share with.",
    "machines": f"'machines' must be a non-empty list of up to {MAX_MACHINES} machine ids (mach_…), or left out for "
                "all your machines.",
    "machines[*]": Refusal("'machines' must list machine ids (mach_…).", param="machines"),
    **{name: _whole(name, 1, MAX_DAILY_LIMIT, True) for name in ("daily_request_limit", "daily_token_limit")},
    **{name: _whole(name, 0, MAX_PRICE, False) for name in ("input_price", "output_price")},
    "expires_at": _EXPIRY,
}
SHARE_CREATE = BodySchema(ShareCreate, _NAMED_400S, unknown="Unknown share field(s): {names}. It takes {known}.")
SHARE_UPDATE = BodySchema(ShareUpdate, _NAMED_400S, unknown="Unknown share field(s): {names}. It takes {known}.")
SHARE_ANSWER = BodySchema(ShareAnswer, _NAMED_400S, unknown="Unknown accept field(s): {names}. It takes {known}.")


def share_fields(body: dict[str, Any], *, owner_email: str | None, now: float) -> dict[str, Any]:
    """Store columns from a POST /v1/shares body; every bad value and unknown field is a named 400."""
    SHARE_CREATE.validate(body)
    email = body["email"].strip().lower()
    if owner_email is not None and email == owner_email:
        raise invalid_request("You cannot share machines with yourself: your own machines already serve you "
                              "(X-Darkbloom-Route: self).", param="email")
    defaults = {"machines": None, "daily_request_limit": None, "daily_token_limit": None, "input_price": 0,
                "output_price": 0, "expires_at": None}
    return {"grantee_email": email, **_columns({**defaults, **body}, now)}


def share_changes(body: dict[str, Any], *, now: float) -> dict[str, Any]:
    """Store columns for the fields a PATCH /v1/shares/{id} body names (the email never changes: a
    share for someone else is a new share)."""
    SHARE_UPDATE.validate(body)
    return _columns(body, now)


def shown_terms(body: dict[str, Any]) -> dict[str, Any]:
    """The terms an accept or decline says its grantee was shown (each optional): the share's
    columns they must still equal."""
    SHARE_ANSWER.validate(body)
    return _columns(body, now=0)


def _columns(body: dict[str, Any], now: float) -> dict[str, Any]:
    fields: dict[str, Any] = {name: body[name] for name in ("daily_request_limit", "daily_token_limit", "input_price",
                                            "output_price") if name in body}
    if "machines" in body:
        fields["machine_ids"] = _machines(body["machines"])
    if "expires_at" in body:
        fields["expires_at"] = _expiry(body["expires_at"], now)
    return fields


def _machines(value: list[str] | str | None) -> list[str] | None:
    if value is None or value == "all":
        return None
    if not all(_MACHINE_ID.match(item) for item in value):
        raise machine_not_found()
    return sorted(set(value))


def _expiry(value: str | None, now: float) -> int | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise invalid_request(_EXPIRY, param="expires_at") from None
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
