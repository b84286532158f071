"""Validation and shaping of consumer API keys (docs/api.md "API keys", "API key fields")."""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

from darkbloom.wire.openai.errors import invalid_request

LIMIT_RESETS = ("none", "daily", "weekly", "monthly")
_RATE_FIELDS = ("rpm_limit", "itpm_limit", "otpm_limit")
_MAX_RATE = 2**31 - 1        # INTEGER column
_MAX_MICRO_USD = 2**63 - 1   # BIGINT column
KEY_FIELDS = ("name", "self_route_only", "shared_only", "limit_usd", "limit_reset", "fallback_limit_usd",
              "fallback_limit_reset", "expires_at", "disabled", *_RATE_FIELDS, "allowed_models", "max_shared_price")
_MAX_SHARED_PRICE = 10**12   # µUSD per 1M tokens, the highest price a share may carry
_MONEY_FIELDS = {"limit_usd": ("limit_micro_usd", "limit_reset"),
                 "fallback_limit_usd": ("fallback_limit_micro_usd", "fallback_limit_reset")}


def key_fields(body: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    """Store columns from a create/patch body; every bad value and every unknown field is a named 400."""
    _refuse_unknown(body)
    fields: dict[str, Any] = {}
    if "name" in body or creating:
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise invalid_request("'name' must be a non-empty string of at most 200 characters.", param="name")
        fields["name"] = name.strip()
    for flag in ("self_route_only", "shared_only", "disabled"):
        if flag in body:
            if not isinstance(body[flag], bool):
                raise invalid_request(f"invalid value for {flag}", param=flag)
            fields[flag] = body[flag]
    for name, (column, reset) in _MONEY_FIELDS.items():
        if name in body:
            fields[column] = _micro_usd(body[name], name)
        if reset in body:
            if body[reset] not in LIMIT_RESETS:
                raise invalid_request(f"'{reset}' must be one of {', '.join(LIMIT_RESETS)}.", param=reset)
            fields[reset] = body[reset]
    if "expires_at" in body:
        fields["expires_at"] = _expiry(body["expires_at"])
    for field in _RATE_FIELDS:
        if field in body:
            value = body[field]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= _MAX_RATE):
                raise invalid_request(f"'{field}' must be a positive integer (at most {_MAX_RATE}) or null.",
                                      param=field)
            fields[field] = value
    if "allowed_models" in body:
        models = body["allowed_models"]
        if models is not None and (not isinstance(models, list)
                                   or not all(isinstance(m, str) and m for m in models)):
            raise invalid_request("'allowed_models' must be a list of model ids or null.", param="allowed_models")
        fields["allowed_models"] = sorted(set(models)) if models is not None else None
    if "max_shared_price" in body:
        ceiling = body["max_shared_price"]
        if ceiling is not None and (not isinstance(ceiling, int) or isinstance(ceiling, bool)
                                    or not 0 <= ceiling <= _MAX_SHARED_PRICE):
            raise invalid_request("'max_shared_price' must be an integer from 0 to "
                                  f"{_MAX_SHARED_PRICE} (µUSD per 1M tokens; 0: free shares only) or null.",
                                  param="max_shared_price")
        fields["max_shared_price"] = ceiling
    return fields


def _refuse_unknown(body: dict[str, Any]) -> None:
    unknown = [name[:64] for name in body if name not in KEY_FIELDS]
    if unknown:
        names = ", ".join(f"'{name}'" for name in unknown[:5]) + (", …" if len(unknown) > 5 else "")
        raise invalid_request(f"Unknown or not supported API key field(s): {names}. "
                              f"A key takes {', '.join(KEY_FIELDS)}.", param=unknown[0])


def _micro_usd(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise invalid_request(f"'{name}' must be a number of US dollars or null.", param=name)
    try:
        micro = Decimal(str(value)) * 1_000_000
    except InvalidOperation:
        raise invalid_request(f"'{name}' must be a number of US dollars or null.", param=name) from None
    if micro < 0 or micro != micro.to_integral_value():
        raise invalid_request(f"'{name}' must be ≥ 0 with at most 6 decimal places.", param=name)
    if micro > _MAX_MICRO_USD:
        raise invalid_request(f"'{name}' is too large.", param=name)
    return int(micro)


def _expiry(value: Any) -> int | None:
    """Unix seconds from an ISO-8601 date-time in the future (UTC when it names no offset); null clears."""
    if value is None:
        return None
    bad = invalid_request("'expires_at' must be an ISO-8601 date-time (e.g. 2030-01-31T00:00:00Z) or null.",
                          param="expires_at")
    if not isinstance(value, str) or len(value) > 64:
        raise bad
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise bad from None
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
