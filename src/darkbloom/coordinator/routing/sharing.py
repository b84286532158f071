"""Routing over shared machines (docs/sharing.md): the shares a ``shared`` request may use, read
from the database for each request (so a revoked share is refused at once on every replica), their
daily allowance, and the errors only shared routing has. The request's lifecycle takes
and gives back a share's daily allowance (``inference/settlement.py``); placement narrows a request
to the share it was admitted on."""

from __future__ import annotations

import time
from dataclasses import dataclass

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.routing.decision import ShareGrant
from darkbloom.coordinator.services import Services
from darkbloom.store import shares
from darkbloom.store.insight import DAY
from darkbloom.wire.openai.errors import ApiError


@dataclass(frozen=True)
class Grants:
    """The shares a request may use now, and those whose allowance for today is used up."""

    usable: tuple[ShareGrant, ...]
    exhausted: tuple[ShareGrant, ...]


def share_not_found() -> ApiError:
    return ApiError(404, "share_not_found", "No share with this id was given to you. GET /v1/shares lists "
                                            "the shares you received.", param="X-Darkbloom-Share")


def share_not_accepted() -> ApiError:
    return ApiError(409, "share_not_accepted",
                    "You have not accepted this share: accept it first (POST /v1/shares/{id}/accept, or on the "
                    "console's Sharing page) — and again after its owner changes its prices or machines.",
                    param="X-Darkbloom-Share")


def share_above_ceiling(ceiling: int) -> ApiError:
    return ApiError(403, "share_price_above_key_ceiling",
                    f"This share's prices are above this API key's max_shared_price ({ceiling} µUSD per 1M tokens), "
                    "so it never routes through it. Raise the key's ceiling or use another key.",
                    param="X-Darkbloom-Share")


def no_shared_machine() -> ApiError:
    return ApiError(409, "no_shared_machine",
                    "You have no machine of your own and nobody has shared a machine with you. Link one with "
                    "`darkbloom login`, or ask someone to share theirs (POST /v1/shares).")


def seconds_to_utc_midnight(now: float | None = None) -> int:
    now = time.time() if now is None else now
    return max(1, DAY - int(now) % DAY)


def share_quota_exceeded(now: float | None = None) -> ApiError:
    wait = seconds_to_utc_midnight(now)
    return ApiError(429, "share_quota_exceeded",
                    "The machines that could serve this request are shared with you with a daily limit, and "
                    f"today's is used up; it resets at 00:00 UTC, in {wait} s.", headers={"Retry-After": str(wait)})


async def load_grants(services: Services, caller: Caller, share_id: str | None) -> Grants:
    """The shares the caller accepted that are neither revoked nor expired and within its key's
    ``max_shared_price`` (only ``share_id`` when the request names one: 409 ``share_not_accepted``
    when it is addressed to the caller but not accepted, 404 ``share_not_found`` for any other share
    it cannot use), cheapest first,
    split by whether today's request limit still has room."""
    now = time.time()
    day = shares.utc_day(now)
    ceiling = caller.key.max_shared_price if caller.key else None
    async with services.engine.connect() as conn:
        rows = await shares.received(conn, caller.account_id, usable_at=now)
        if share_id is not None:
            rows = [row for row in rows if row["id"] == share_id]
            if not rows:
                named = await shares.addressed_to(conn, share_id, caller.account_id)
                if named is not None and named["status"] != "accepted":
                    raise share_not_accepted()
                raise share_not_found()
            if ceiling is not None and not _within(rows[0], ceiling):
                raise share_above_ceiling(ceiling)
        if ceiling is not None:
            rows = [row for row in rows if _within(row, ceiling)]
        used = {row["id"]: await shares.used_on(conn, row["id"], day)
                for row in rows if row["daily_request_limit"] is not None}
    grants = sorted((_grant(row) for row in rows), key=lambda g: (g.priced, g.input_price + g.output_price, g.id))
    full = {g.id for g in grants
            if g.daily_request_limit is not None and used[g.id]["requests"] >= g.daily_request_limit}
    return Grants(tuple(g for g in grants if g.id not in full), tuple(g for g in grants if g.id in full))


def _within(row: dict[str, object], ceiling: int) -> bool:
    return int(row["input_price"]) <= ceiling and int(row["output_price"]) <= ceiling  # type: ignore[call-overload]


def _grant(row: dict[str, object]) -> ShareGrant:
    machines = row["machine_ids"]
    return ShareGrant(
        id=str(row["id"]), owner_account_id=str(row["owner_account_id"]),
        machine_ids=frozenset(machines) if isinstance(machines, list) else None,
        input_price=int(row["input_price"]), output_price=int(row["output_price"]),  # type: ignore[call-overload]
        daily_request_limit=row["daily_request_limit"],  # type: ignore[arg-type]
        daily_token_limit=row["daily_token_limit"])  # type: ignore[arg-type]


async def take_allowance(services: Services, grant: ShareGrant, token_estimate: int) -> int | None:
    """One request and its token estimate against today's limits of the share: the UTC day it was
    counted on, or None when a limit would be passed (nothing taken)."""
    day = shares.utc_day(time.time())
    async with services.engine.begin() as conn:
        taken = await shares.take(conn, grant.as_row(), day, token_estimate)
    return day if taken else None
