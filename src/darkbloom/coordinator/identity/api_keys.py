"""Consumer API keys (docs/api.md "API keys", "API key fields"): the key a request authenticated
with, the fields a client may write, and the key as the API shows it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Annotated, Any, Literal, Mapping

from pydantic import Field, with_config
from typing_extensions import NotRequired, Required, TypedDict

from darkbloom.wire.openai.body_schema import CLOSED, BodySchema, Refusals
from darkbloom.wire.openai.errors import ApiError, invalid_request

_BEARER = {"WWW-Authenticate": "Bearer"}
LimitReset = Literal["none", "daily", "weekly", "monthly"]
_EXPIRY = "'expires_at' must be an ISO-8601 date-time (e.g. 2030-01-31T00:00:00Z) or null."


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A stored, unrevoked key as authentication, admission, billing and routing read it."""

    id: str
    account_id: str
    name: str
    self_route_only: bool = False
    shared_only: bool = False
    disabled: bool = False
    expires_at: int | None = None                 # Unix seconds
    limit_micro_usd: int | None = None            # spend cap per limit_reset window
    limit_reset: LimitReset = "none"
    fallback_limit_micro_usd: int | None = None   # what prefer requests may spend on the fleet per window
    fallback_limit_reset: LimitReset = "none"
    rpm_limit: int | None = None
    itpm_limit: int | None = None
    otpm_limit: int | None = None
    allowed_models: frozenset[str] | None = None
    max_shared_price: int | None = None           # µUSD per 1M tokens

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ApiKey:
        models = row["allowed_models"]
        return cls(id=row["id"], account_id=row["account_id"], name=row["name"],
                   self_route_only=bool(row["self_route_only"]), shared_only=bool(row["shared_only"]),
                   disabled=bool(row["disabled"]), expires_at=row["expires_at"],
                   limit_micro_usd=row["limit_micro_usd"], limit_reset=row["limit_reset"],
                   fallback_limit_micro_usd=row["fallback_limit_micro_usd"],
                   fallback_limit_reset=row["fallback_limit_reset"], rpm_limit=row["rpm_limit"],
                   itpm_limit=row["itpm_limit"], otpm_limit=row["otpm_limit"],
                   allowed_models=frozenset(models) if models is not None else None,
                   max_shared_price=row["max_shared_price"])

    def refusal(self) -> ApiError | None:
        """The 401 of a disabled or expired key, which authenticates nothing (checked on every request: a
        cached grant carries the key, and an expiry needs no change to be announced); None: usable."""
        if self.disabled:
            return ApiError(401, "key_disabled", "This API key is disabled. Enable it again (PATCH /v1/keys/{id} "
                                                 "with \"disabled\": false) or use another key.", headers=_BEARER)
        if self.expires_at is not None and self.expires_at <= time.time():
            return ApiError(401, "key_expired", "This API key has expired. Set a later expires_at on it (or null) "
                                                "from a console session, or create a new key.", headers=_BEARER)
        return None

    @property
    def restricted(self) -> bool:
        """Someone chose to limit it (self-route or shared only, a spend cap or fallback budget, an
        expiry, a model list, rate limits, a ceiling on share prices): if it leaks, it must not be able
        to widen itself, mint an unrestricted key or link a machine."""
        return self.self_route_only or self.shared_only or any(limit is not None for limit in (
            self.limit_micro_usd, self.fallback_limit_micro_usd, self.expires_at, self.allowed_models,
            self.rpm_limit, self.itpm_limit, self.otpm_limit, self.max_shared_price))


_MAX_RATE = 2**31 - 1        # INTEGER column
_MAX_MICRO_USD = 2**63 - 1   # BIGINT column
_MAX_SHARED_PRICE = 10**12   # µUSD per 1M tokens, the highest price a share may carry
_MONEY_FIELDS = {"limit_usd": "limit_micro_usd", "fallback_limit_usd": "fallback_limit_micro_usd"}
_COPIED = ("self_route_only", "shared_only", "disabled", "limit_reset", "fallback_limit_reset", "rpm_limit",
           "itpm_limit", "otpm_limit", "max_shared_price")

Dollars = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Rate = Annotated[int, Field(ge=1, le=_MAX_RATE)]


@with_config(CLOSED)
class _KeySettings(TypedDict, total=False):
    self_route_only: Annotated[bool, Field(description="Serve only on your own machines, always free.")]
    shared_only: Annotated[bool, Field(description="Serve only on your own machines and those shared with you "
                                                   "(X-Darkbloom-Route: shared on every request).")]
    limit_usd: Annotated[Dollars | None, Field(description="Spend cap in US dollars (≤ 6 decimals).")]
    limit_reset: LimitReset
    fallback_limit_usd: Annotated[Dollars | None, Field(description=(
        "The most prefer requests on this key may spend on the public fleet per window, in US dollars; past it "
        "(or when a request's worst case would pass it) prefer acts as exclusive until the window resets."))]
    fallback_limit_reset: LimitReset
    expires_at: Annotated[Annotated[str, Field(max_length=64)] | None, Field(
        json_schema_extra={"format": "date-time"}, description=(
            "ISO-8601, in the future (UTC when it names no offset); null: never expires. An expired key is 401 "
            "key_expired."))]
    disabled: Annotated[bool, Field(description="A disabled key is 401 key_disabled until enabled again.")]
    rpm_limit: Rate | None
    itpm_limit: Rate | None
    otpm_limit: Rate | None
    allowed_models: list[Annotated[str, Field(min_length=1)]] | None
    max_shared_price: Annotated[Annotated[int, Field(ge=0, le=_MAX_SHARED_PRICE)] | None, Field(description=(
        "Shared routing on this key never uses a share whose input or output price (µUSD per 1M tokens) is above "
        "this; null: no ceiling."))]


KeyName = Annotated[str, Field(pattern=r"\S", max_length=200)]


@with_config(CLOSED)
class ApiKeyCreate(_KeySettings):
    name: Required[KeyName]


@with_config(CLOSED)
class ApiKeyUpdate(_KeySettings):
    name: NotRequired[KeyName]


_NAMED_400S: Refusals = {
    "name": "'name' must be a non-empty string of at most 200 characters.",
    **{flag: f"'{flag}' must be a boolean." for flag in ("self_route_only", "shared_only", "disabled")},
    **{name: f"'{name}' must be a number of US dollars or null." for name in _MONEY_FIELDS},
    **{f"{name}/greater_than_equal": f"'{name}' must be ≥ 0 with at most 6 decimal places." for name in _MONEY_FIELDS},
    **{reset: f"'{reset}' must be one of none, daily, weekly, monthly."
       for reset in ("limit_reset", "fallback_limit_reset")},
    "expires_at": _EXPIRY,
    **{rate: f"'{rate}' must be a positive integer (at most {_MAX_RATE}) or null."
       for rate in ("rpm_limit", "itpm_limit", "otpm_limit")},
    "allowed_models": "'allowed_models' must be a list of model ids or null.",
    "max_shared_price": f"'max_shared_price' must be an integer from 0 to {_MAX_SHARED_PRICE} (µUSD per 1M tokens; "
                        "0: free shares only) or null.",
}
_UNKNOWN = "Unknown or not supported API key field(s): {names}. A key takes {known}."
KEY_CREATE = BodySchema(ApiKeyCreate, _NAMED_400S, unknown=_UNKNOWN)
KEY_UPDATE = BodySchema(ApiKeyUpdate, _NAMED_400S, unknown=_UNKNOWN)


def key_fields(body: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    """Store columns from a create/patch body; every bad value and every unknown field is a named 400."""
    (KEY_CREATE if creating else KEY_UPDATE).validate(body)
    fields: dict[str, Any] = {name: body[name] for name in _COPIED if name in body}
    if "name" in body:
        fields["name"] = body["name"].strip()
    for name, column in _MONEY_FIELDS.items():
        if name in body:
            fields[column] = _micro_usd(body[name], name)
    if "expires_at" in body:
        fields["expires_at"] = _expiry(body["expires_at"])
    if "allowed_models" in body:
        models = body["allowed_models"]
        fields["allowed_models"] = sorted(set(models)) if models is not None else None
    return fields


def _micro_usd(value: float | None, name: str) -> int | None:
    """Exact µUSD from a checked dollar amount (ints stay exact; a float as its shortest decimal)."""
    if value is None:
        return None
    micro = Decimal(str(value)) * 1_000_000
    if micro != micro.to_integral_value():
        raise invalid_request(f"'{name}' must be ≥ 0 with at most 6 decimal places.", param=name)
    if micro > _MAX_MICRO_USD:
        raise invalid_request(f"'{name}' is too large.", param=name)
    return int(micro)


def _expiry(value: str | None) -> int | None:
    """Unix seconds from an ISO-8601 date-time in the future (UTC when it names no offset); null clears."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise invalid_request(_EXPIRY, param="expires_at") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    seconds = math.ceil(when.timestamp())
    if seconds <= time.time():
        raise invalid_request("'expires_at' must be in the future; send null to make the key never expire.",
                              param="expires_at")
    return seconds


def iso_utc(seconds: int | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _usd(micro: int | None) -> float | None:
    return None if micro is None else float(Decimal(micro) / 1_000_000)


def key_view(row: dict[str, Any]) -> dict[str, Any]:
    limit, fallback = row["limit_micro_usd"], row["fallback_limit_micro_usd"]
    return {
        "id": row["id"], "object": "api_key", "name": row["name"], "key_prefix": row["key_prefix"],
        "self_route_only": bool(row["self_route_only"]), "shared_only": bool(row["shared_only"]),
        "limit_usd": _usd(limit), "limit_micro_usd": limit, "limit_reset": row["limit_reset"],
        "fallback_limit_usd": _usd(fallback), "fallback_limit_micro_usd": fallback,
        "fallback_limit_reset": row["fallback_limit_reset"],
        "expires_at": iso_utc(row["expires_at"]), "disabled": bool(row["disabled"]),
        "rpm_limit": row["rpm_limit"], "itpm_limit": row["itpm_limit"], "otpm_limit": row["otpm_limit"],
        "allowed_models": row["allowed_models"], "max_shared_price": row["max_shared_price"],
        "created_at": row["created_at"],
        "last_used_at": row["last_used_at"],
    }
