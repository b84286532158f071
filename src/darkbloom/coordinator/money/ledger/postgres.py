"""The ledger writer's Postgres side, on the raw asyncpg connection of one pooled engine connection.

A batch is one transaction: lock and read the rows it touches with set-based ``SELECT … FOR UPDATE``
in ONE statement, in the one global lock order (reservations by request id, then key windows, then
accounts by id; so two coordinators' batches never deadlock), run ``rules.plan``, then write
every change in ONE statement (data-modifying CTEs over ``unnest`` arrays). Round trips per batch,
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
_WRITE = """
WITH
a AS (UPDATE accounts AS t SET balance_micro_usd = v.b, withdrawable_micro_usd = v.w
      FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS v(id, b, w) WHERE t.id = v.id),
kn AS (INSERT INTO key_spend (key_id, window_start, spent_micro_usd, reserved_micro_usd)
       SELECT * FROM unnest($4::text[], $5::bigint[], $6::bigint[], $7::bigint[])),
ku AS (UPDATE key_spend AS t SET spent_micro_usd = v.s, reserved_micro_usd = v.r
       FROM unnest($8::text[], $9::bigint[], $10::bigint[], $11::bigint[]) AS v(k, ws, s, r)
       WHERE t.key_id = v.k AND t.window_start = v.ws),
rn AS (INSERT INTO reservations (request_id, account_id, key_id, amount_micro_usd, window_start, status,
                                 instance_id, created_at, closed_at, fallback_window_start)
       SELECT v.r, v.acc, v.k, v.m, v.ws, v.s, v.i, $32::bigint, CASE WHEN v.s = 'open' THEN NULL ELSE $32::bigint END,
              v.fw
       FROM unnest($12::text[], $13::text[], $14::text[], $15::bigint[], $16::bigint[], $17::text[],
                   $18::text[], $43::bigint[]) AS v(r, acc, k, m, ws, s, i, fw)),
rc AS (UPDATE reservations AS t SET status = v.s, closed_at = $32::bigint
       FROM unnest($19::text[], $20::text[]) AS v(r, s) WHERE t.request_id = v.r),
p AS (UPDATE accounts SET balance_micro_usd = balance_micro_usd + $45::bigint,
                          withdrawable_micro_usd = withdrawable_micro_usd + $46::bigint
      WHERE id = $47::text
      RETURNING balance_micro_usd - $45::bigint AS b, withdrawable_micro_usd - $46::bigint AS w),
shift AS (SELECT coalesce((SELECT b FROM p), $48::bigint) - $48::bigint AS b,
                 coalesce((SELECT w FROM p), $49::bigint) - $49::bigint AS w),
le AS (INSERT INTO ledger_entries (account_id, kind, pocket, amount_micro_usd, balance_after, request_id,
                                   created_at)
       SELECT v.acc, v.k, v.p, v.m,
              v.b + CASE WHEN v.acc = $47::text THEN CASE WHEN v.p = 'balance' THEN s.b ELSE s.w END ELSE 0 END,
              v.r, $32::bigint
       FROM unnest($21::text[], $22::text[], $23::text[], $24::bigint[], $25::bigint[], $26::text[])
            WITH ORDINALITY AS v(acc, k, p, m, b, r, n), shift AS s ORDER BY v.n),
u AS (INSERT INTO usage_records (request_id, account_id, key_id, model, provider_id, provider_account_id,
                                 prompt_tokens, completion_tokens, cost_micro_usd, platform_fee_micro_usd,
                                 provider_payout_micro_usd, self_routed, routed, created_at, ownership_changed,
                                 share_id, machine_id)
      SELECT v.r, v.acc, v.k, v.m, v.p, v.pa, v.pt, v.ct, v.c, v.f, v.po, v.s, v.ro, $32::bigint, v.oc, v.sh, v.mi
      FROM unnest($27::text[], $28::text[], $29::text[], $30::text[], $31::text[], $33::text[], $34::bigint[],
                  $35::bigint[], $36::bigint[], $37::bigint[], $38::bigint[], $39::boolean[], $40::text[],
                  $41::boolean[], $42::text[], $44::text[]) AS v(r, acc, k, m, p, pa, pt, ct, c, f, po, s, ro, oc, sh,
                                                                 mi))
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
        credited = "" if _platform_locked_at_read(steps) else PLATFORM_ACCOUNT_ID
        try:
            async with raw.transaction():
                state = await _read(raw, steps, credited)
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


async def _read(raw: Any, steps: list[Step], credited: str) -> State:
    """One round trip: the rows the batch needs, locked (its reservations' own windows and accounts
    included, the platform's last) — unless ``credited`` names the platform: then its row is read as
    it stands."""
    state = State()
    reserving = rules.window_keys(steps, {})
    rows = await raw.fetch(_LOCK_BUT_PLATFORM if credited else _LOCK_ALL, rules.reservation_ids(steps),
                           [k for k, _ in reserving], [w for _, w in reserving], rules.account_ids(steps, {}),
                           rules.usage_ids(steps), FALLBACK_PREFIX, PLATFORM_ACCOUNT_ID)
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
    """The write statement's arguments: one array per column, $1 … $44; then what ``credited`` (read
    as ``read``) gains, as additions, $45 … $49."""
    accounts = [(k, v) for k, v in changes.accounts.items() if k != credited]
    gained = changes.accounts.get(credited)
    new = [(k, v) for k, v in changes.windows.items() if k in changes.new_windows]
    old = [(k, v) for k, v in changes.windows.items() if k not in changes.new_windows]
    reservations = list(changes.new_reservations.values())
    closed = list(changes.closed.items())
    entries, usage = changes.entries, changes.usage

    def col(rows: list[Any], pick: Any) -> list[Any]:
        return [pick(row) for row in rows]

    return [
        col(accounts, lambda a: a[0]), col(accounts, lambda a: a[1][0]), col(accounts, lambda a: a[1][1]),
        col(new, lambda w: w[0][0]), col(new, lambda w: w[0][1]), col(new, lambda w: w[1][0]),
        col(new, lambda w: w[1][1]),
        col(old, lambda w: w[0][0]), col(old, lambda w: w[0][1]), col(old, lambda w: w[1][0]),
        col(old, lambda w: w[1][1]),
        *[col(reservations, lambda r, c=c: r[c]) for c in ("request_id", "account_id", "key_id",
                                                         "amount_micro_usd", "window_start", "status",
                                                         "instance_id")],
        col(closed, lambda c: c[0]), col(closed, lambda c: c[1]),
        *[col(entries, lambda e, i=i: e[i]) for i in range(6)],
        *[col(usage, lambda u, i=i: u[i]) for i in range(5)],
        changes.now,
        *[col(usage, lambda u, i=i: u[i]) for i in range(5, 13)],
        col(usage, lambda u: u[14]), col(usage, lambda u: u[15]),
        col(reservations, lambda r: r.get("fallback_window_start")),
        col(usage, lambda u: u[16]),
        gained[0] - read[0] if gained else 0, gained[1] - read[1] if gained else 0,
        credited if gained else "", read[0], read[1],
    ]
