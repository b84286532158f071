"""Validation and shaping of consumer API keys (docs/api.md "API keys", "API key fields")."""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Any

from darkbloom.wire.openai.errors import invalid_request

LIMIT_RESETS = ("none", "daily", "weekly", "monthly")
_RATE_FIELDS = ("rpm_limit", "itpm_limit", "otpm_limit")
_MAX_RATE = 2**31 - 1        # INTEGER column
_MAX_MICRO_USD = 2**63 - 1   # BIGINT column
KEY_FIELDS = ("name", "self_route_only", "shared_only", "limit_usd", "limit_reset", *_RATE_FIELDS, "allowed_models")


def key_fields(body: dict[str, Any], *, creating: bool) -> dict[str, Any]:
    """Store columns from a create/patch body; every bad value and every unknown field is a named 400."""
    _refuse_unknown(body)
    fields: dict[str, Any] = {}
    if "name" in body or creating:
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise invalid_request("'name' must be a non-empty string of at most 200 characters.", param="name")
        fields["name"] = name.strip()
    for flag in ("self_route_only", "shared_only"):
        if flag in body:
            if not isinstance(body[flag], bool):
                raise invalid_request(f"invalid value for {flag}", param=flag)
            fields[flag] = body[flag]
    if "limit_usd" in body:
        fields["limit_micro_usd"] = _micro_usd(body["limit_usd"])
    if "limit_reset" in body:
        if body["limit_reset"] not in LIMIT_RESETS:
            raise invalid_request(f"'limit_reset' must be one of {', '.join(LIMIT_RESETS)}.", param="limit_reset")
        fields["limit_reset"] = body["limit_reset"]
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
    return fields


def _refuse_unknown(body: dict[str, Any]) -> None:
    unknown = [name[:64] for name in body if name not in KEY_FIELDS]
    if unknown:
        names = ", ".join(f"'{name}'" for name in unknown[:5]) + (", …" if len(unknown) > 5 else "")
        raise invalid_request(f"Unknown or not supported API key field(s): {names}. "
                              f"A key takes {', '.join(KEY_FIELDS)}.", param=unknown[0])


def _micro_usd(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise invalid_request("'limit_usd' must be a number of US dollars or null.", param="limit_usd")
    try:
        micro = Decimal(str(value)) * 1_000_000
    except InvalidOperation:
        raise invalid_request("'limit_usd' must be a number of US dollars or null.", param="limit_usd") from None
    if micro < 0 or micro != micro.to_integral_value():
        raise invalid_request("'limit_usd' must be ≥ 0 with at most 6 decimal places.", param="limit_usd")
    if micro > _MAX_MICRO_USD:
        raise invalid_request("'limit_usd' is too large.", param="limit_usd")
    return int(micro)


def key_view(row: dict[str, Any]) -> dict[str, Any]:
    limit = row["limit_micro_usd"]
    return {
        "id": row["id"], "object": "api_key", "name": row["name"], "key_prefix": row["key_prefix"],
        "self_route_only": bool(row["self_route_only"]), "shared_only": bool(row["shared_only"]),
        "limit_usd": None if limit is None else float(Decimal(limit) / 1_000_000),
        "limit_micro_usd": limit, "limit_reset": row["limit_reset"],
        "rpm_limit": row["rpm_limit"], "itpm_limit": row["itpm_limit"], "otpm_limit": row["otpm_limit"],
        "allowed_models": row["allowed_models"], "created_at": row["created_at"],
        "last_used_at": row["last_used_at"],
    }
