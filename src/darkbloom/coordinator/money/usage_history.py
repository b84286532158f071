"""An account's usage rows as the API shows them, over time per UTC day (for the console's chart),
and every row as CSV."""

from __future__ import annotations

import csv
import datetime
import io
import time
from typing import Any, AsyncIterator

from darkbloom.coordinator.services import Services
from darkbloom.store import insight
from darkbloom.wire.openai.errors import invalid_request

MAX_DAYS = 366
CSV_MAX_ROWS = 100_000
CSV_COLUMNS = ("request_id", "created_at", "model", "provider_id", "prompt_tokens", "completion_tokens",
               "cost_micro_usd", "self_routed", "routed", "share_id")


def row_view(r: dict[str, Any]) -> dict[str, Any]:
    """The documented row (docs/api.md "Usage rows"), plus the flags only where they apply: the share
    that served, an exclusive request whose machine changed owner mid-flight (still free), and the batch
    and line of a batch line's request."""
    return {
        "request_id": r["request_id"], "created_at": r["created_at"], "model": r["model"],
        "provider_id": r["provider_id"], "prompt_tokens": r["prompt_tokens"],
        "completion_tokens": r["completion_tokens"], "cost_micro_usd": r["cost_micro_usd"],
        "self_routed": bool(r["self_routed"]), "routed": r["routed"],
        **({"share_id": r["share_id"]} if r.get("share_id") else {}),
        **({"ownership_changed": True} if r["ownership_changed"] else {}),
        **({"batch_id": r["batch_id"], "custom_id": r["custom_id"]} if r.get("batch_id") else {})}


async def daily(services: Services, account_id: str, days: int) -> list[dict[str, Any]]:
    """The last ``days`` UTC days, oldest first (today included), days without use as zeros."""
    if not 1 <= days <= MAX_DAYS:
        raise invalid_request(f"'days' must be a whole number from 1 to {MAX_DAYS}.", param="days")
    today = int(time.time()) // insight.DAY
    first = today - days + 1
    async with services.engine.connect() as conn:
        used = await insight.daily(conn, account_id, first * insight.DAY)
    zero = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_micro_usd": 0}
    epoch = datetime.date(1970, 1, 1)
    return [{"date": (epoch + datetime.timedelta(days=day)).isoformat(), **used.get(day, zero)}
            for day in range(first, today + 1)]


async def csv_lines(services: Services, account_id: str, limit: int = CSV_MAX_ROWS) -> AsyncIterator[str]:
    """The header, then the account's usage rows newest first (at most ``limit``), a line at a time."""
    yield _line(CSV_COLUMNS)
    async with services.engine.connect() as conn:
        async for row in insight.usage_rows(conn, account_id, limit):
            view = row_view(row)
            yield _line([_cell(view.get(column)) for column in CSV_COLUMNS])


# A spreadsheet runs a cell that starts with one of these as a formula (OWASP "CSV Injection")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> Any:
    """A value as its CSV cell: a text that a spreadsheet would run as a formula (a model id a node
    advertised, say) is prefixed with a single quote, so that it shows as the text it is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return "" if value is None else value


def _line(values: Any) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerow(values)
    return out.getvalue()
