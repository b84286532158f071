"""The ledger writer's Postgres side, on the raw asyncpg connection of one pooled engine connection.

A batch is one transaction: lock and read the rows it touches with set-based ``SELECT … FOR UPDATE``
in ONE statement, in the one global lock order (reservations by request id, then key windows, then
accounts by id; so two coordinators' batches never deadlock), run ``rules.plan``, then write
every change in ONE statement (data-modifying CTEs over each table's rows as JSON). Round trips per batch,
whatever its size: BEGIN, one read, one write, COMMIT. (The rules stay in Python, shared with
SQLite; a server-side function would save BEGIN and COMMIT but hold a second copy of them.)

The platform account is the exception: every charged settlement of every coordinator credits it (the
fee, and a payout whose owner is gone) and nothing in a batch checks it, so it is always a batch's
last lock, and usually taken late: read without a lock, credited by the write as an addition, its row
held from the write to the commit only, and never by a batch that does not credit it. What other
transactions added meanwhile shifts its new entries' ``balance_after`` in the same statement. A batch
that may create a key window while it credits the platform (or, never in service, has it pay) locks
it at the read instead, still last: two batches creating the same window wait for each other's
insert, so neither may then be waiting for the platform row while the other holds it. Whoever holds
the platform row thus waits at most for another batch's insert of a key window, by a batch that never
waits for the platform row: no wait closes a cycle."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from darkbloom.coordinator.money.ledger import rules
from darkbloom.coordinator.money.ledger.rules import Changes, State, Step
from darkbloom.store.schema import FALLBACK_PREFIX, PLATFORM_ACCOUNT_ID
from darkbloom.wire.json_codec import dumps_text

# One statement locks and reads everything a batch touches. UNION ALL runs its parts in order, each
# locking its rows sorted: reservations, then key windows, then accounts, the platform account last — the
# one global lock order (its row read without a lock when the write will add to it: module docstring).
# The windows (spend cap and fallback budget) and accounts of the reservations being closed come from
# those reservations themselves.
_LOCK = """
SELECT 'r' AS part, request_id AS id, account_id, key_id, amount_micro_usd AS n1, window_start AS n2,
       fallback_window_start AS n3, status, instance_id
FROM (SELECT * FROM reservations WHERE request_id = ANY($1::text[]) ORDER BY request_id FOR UPDATE) r
UNION ALL
SELECT 'w', NULL, NULL, key_id, window_start, spent_micro_usd, reserved_micro_usd, NULL, NULL
FROM (SELECT * FROM key_spend
      WHERE (key_id, window_start) IN (SELECT * FROM unnest($2::text[], $3::bigint[])
                                       UNION SELECT key_id, window_start FROM reservations
                                       WHERE request_id = ANY($1::text[]) AND window_start IS NOT NULL
                                       UNION SELECT $6::text || key_id, fallback_window_start FROM reservations
                                       WHERE request_id = ANY($1::text[]) AND fallback_window_start IS NOT NULL)
      ORDER BY key_id, window_start FOR UPDATE OF key_spend) w
UNION ALL
SELECT 'a', id, NULL, NULL, balance_micro_usd, withdrawable_micro_usd, NULL, NULL, NULL
FROM (SELECT * FROM accounts
      WHERE (id = ANY($4::text[])
             OR id IN (SELECT account_id FROM reservations WHERE request_id = ANY($1::text[])))
        AND id <> $7::text
      ORDER BY id FOR UPDATE OF accounts) a
UNION ALL
SELECT 'a', id, NULL, NULL, balance_micro_usd, withdrawable_micro_usd, NULL, NULL, NULL
FROM (SELECT * FROM accounts WHERE id = $7::text {platform_lock}) p
UNION ALL
SELECT 'u', request_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM usage_records WHERE request_id = ANY($5::text[])"""
_LOCK_ALL, _LOCK_BUT_PLATFORM = _LOCK.format(platform_lock="FOR UPDATE"), _LOCK.format(platform_lock="")
# One statement writes everything. Each table's rows come as one JSON array of objects keyed by column
# name (json_populate_recordset types them from the table): one parameter per table, where one array
# parameter per column cost asyncpg ~1 µs of encoding each, ~50 µs a batch at 49 of them.
_WRITE = """
WITH
a AS (UPDATE accounts AS t
      SET balance_micro_usd = v.balance_micro_usd, withdrawable_micro_usd = v.withdrawable_micro_usd
      FROM json_populate_recordset(NULL::accounts, $1::json) AS v WHERE t.id = v.id),
kn AS (INSERT INTO key_spend (key_id, window_start, spent_micro_usd, reserved_micro_usd)
       SELECT key_id, window_start, spent_micro_usd, reserved_micro_usd
       FROM json_populate_recordset(NULL::key_spend, $2::json)),
ku AS (UPDATE key_spend AS t SET spent_micro_usd = v.spent_micro_usd, reserved_micro_usd = v.reserved_micro_usd
       FROM json_populate_recordset(NULL::key_spend, $3::json) AS v
       WHERE t.key_id = v.key_id AND t.window_start = v.window_start),
rn AS (INSERT INTO reservations (request_id, account_id, key_id, amount_micro_usd, window_start, status,
                                 instance_id, created_at, closed_at, fallback_window_start)
       SELECT request_id, account_id, key_id, amount_micro_usd, window_start, status, instance_id, created_at,
              closed_at, fallback_window_start
       FROM json_populate_recordset(NULL::reservations, $4::json)),
rc AS (UPDATE reservations AS t SET status = v.status, closed_at = $8::bigint
       FROM json_populate_recordset(NULL::reservations, $5::json) AS v WHERE t.request_id = v.request_id),
p AS (UPDATE accounts SET balance_micro_usd = balance_micro_usd + $9::bigint,
                          withdrawable_micro_usd = withdrawable_micro_usd + $10::bigint
      WHERE id = $11::text
      RETURNING balance_micro_usd - $9::bigint AS b, withdrawable_micro_usd - $10::bigint AS w),
shift AS (SELECT coalesce((SELECT b FROM p), $12::bigint) - $12::bigint AS b,
                 coalesce((SELECT w FROM p), $13::bigint) - $13::bigint AS w),
le AS (INSERT INTO ledger_entries (account_id, kind, pocket, amount_micro_usd, balance_after, request_id,
                                   created_at)
       SELECT v.account_id, v.kind, v.pocket, v.amount_micro_usd,
              v.balance_after + CASE WHEN v.account_id = $11::text
                                     THEN CASE WHEN v.pocket = 'balance' THEN s.b ELSE s.w END ELSE 0 END,
              v.request_id, $8::bigint
       FROM json_populate_recordset(NULL::ledger_entries, $6::json) WITH ORDINALITY AS v, shift AS s
       ORDER BY v.ordinality),
u AS (INSERT INTO usage_records (request_id, account_id, key_id, model, provider_id, provider_account_id,
                                 prompt_tokens, completion_tokens, cost_micro_usd, platform_fee_micro_usd,
                                 provider_payout_micro_usd, self_routed, routed, created_at, ownership_changed,
                                 share_id, machine_id)
      SELECT request_id, account_id, key_id, model, provider_id, provider_account_id, prompt_tokens,
             completion_tokens, cost_micro_usd, platform_fee_micro_usd, provider_payout_micro_usd, self_routed, routed,
             created_at, ownership_changed, share_id, machine_id
      FROM json_populate_recordset(NULL::usage_records, $7::json))
SELECT count(*) FROM p"""


class PostgresLedger:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None
        self._raw: Any = None

    async def _connection(self) -> Any:
        if self._raw is None or self._raw.is_closed():
            await self._discard()
            self._conn = await self._engine.connect()
            self._raw = (await self._conn.get_raw_connection()).driver_connection
            # Plan each batch for its own arrays: a cached generic plan, made while the tables were
            # small, would keep scanning them whole as they grow (until the next ANALYZE).
            await self._raw.execute("SET plan_cache_mode = force_custom_plan")
        return self._raw

    async def _discard(self) -> None:
        conn, self._conn, self._raw = self._conn, None, None
        if conn is not None:
            try:
                await conn.invalidate()
                await conn.close()
            except Exception:  # noqa: BLE001 - the connection is gone either way
                pass

    async def apply(self, steps: list[Step]) -> list[Any]:
        raw = await self._connection()
        platform_at_read = _platform_locked_at_read(steps)
        credited = "" if platform_at_read else PLATFORM_ACCOUNT_ID  # the account the write adds to
        try:
            async with raw.transaction():
                state = await _read(raw, steps, platform_at_read)
                read = tuple(state.accounts.get(credited, (0, 0)))
                results, changes = rules.plan(steps, state, int(time.time()))
                if not changes.empty():
                    added = await raw.fetchval(_WRITE, *_columns(changes, credited, read))
                    if credited in changes.accounts and not added:
                        raise LookupError(f"the account {credited} is missing: its credits cannot be written")
        except BaseException:
            if raw.is_closed() or raw.is_in_transaction():
                await self._discard()  # broken, or a cancelled transaction left half-open
            raise
        return results

    async def close(self) -> None:
        conn, raw, self._conn, self._raw = self._conn, self._raw, None, None
        if conn is not None:
            if raw is not None and not raw.is_closed():
                await raw.execute("RESET plan_cache_mode")  # back to the pool as it came
            await conn.close()


def _platform_locked_at_read(steps: list[Step]) -> bool:
    """Whether the batch takes the platform row at its read (still its last lock) rather than at its
    write: when it may create a key window (a reservation against a cap or a fallback budget) and
    credit the platform (a charged settlement) in one transaction, or has the platform pay."""
    windowed = any(isinstance(step, rules.Reserve) and (step.cap is not None or step.fallback_cap is not None)
                   for step in steps)
    crediting = any(isinstance(step, rules.Settle) and step.cost > 0 for step in steps)
    paying = any(isinstance(step, (rules.Reserve, rules.Settle)) and step.account_id == PLATFORM_ACCOUNT_ID
                 for step in steps)
    return (windowed and crediting) or paying


async def _read(raw: Any, steps: list[Step], platform_at_read: bool) -> State:
    """One round trip: the rows the batch needs, locked (its reservations' own windows and accounts
    included, the platform's last; without ``platform_at_read``, the platform's row read as it stands)."""
    state = State()
    reserving = rules.window_keys(steps, {})
    rows = await raw.fetch(_LOCK_ALL if platform_at_read else _LOCK_BUT_PLATFORM,
                           rules.reservation_ids(steps), [k for k, _ in reserving], [w for _, w in reserving],
                           rules.account_ids(steps, {}), rules.usage_ids(steps), FALLBACK_PREFIX, PLATFORM_ACCOUNT_ID)
    for row in rows:
        part = row["part"]
        if part == "r":
            state.reservations[row["id"]] = {
                "request_id": row["id"], "account_id": row["account_id"], "key_id": row["key_id"],
                "amount_micro_usd": row["n1"], "window_start": row["n2"], "status": row["status"],
                "instance_id": row["instance_id"], "fallback_window_start": row["n3"]}
        elif part == "w":
            state.windows[(row["key_id"], int(row["n1"]))] = [int(row["n2"]), int(row["n3"])]
        elif part == "a":
            state.accounts[row["id"]] = [int(row["n1"]), int(row["n2"])]
        else:
            state.used.add(row["id"])
    return state


def _columns(changes: Changes, credited: str, read: tuple[int, ...]) -> list[Any]:
    """The write statement's arguments: each table's rows as JSON ($1 … $7), the time ($8), then what
    ``credited`` (read as ``read``) gains, as additions ($9 … $13)."""
    gained = changes.accounts.get(credited)

    def windows(new: bool) -> str:
        return dumps_text([{"key_id": key[0], "window_start": key[1], "spent_micro_usd": values[0],
                            "reserved_micro_usd": values[1]}
                           for key, values in changes.windows.items() if (key in changes.new_windows) == new])

    return [
        dumps_text([{"id": k, "balance_micro_usd": v[0], "withdrawable_micro_usd": v[1]}
                    for k, v in changes.accounts.items() if k != credited]),
        windows(True), windows(False),
        dumps_text(list(changes.new_reservations.values())),
        dumps_text([{"request_id": r, "status": status} for r, status in changes.closed.items()]),
        dumps_text([dict(zip(rules.ENTRY_COLUMNS, entry)) for entry in changes.entries]),
        dumps_text([dict(zip(rules.USAGE_COLUMNS, row)) for row in changes.usage]),
        changes.now,
        gained[0] - read[0] if gained else 0, gained[1] - read[1] if gained else 0,
        credited if gained else "", read[0], read[1],
    ]
