"""The ledger writer's Postgres side, on the raw asyncpg connection of one pooled engine connection.

A batch is one or two statements, one round trip each, with no transaction around them: ONE read
of every row it touches, from one snapshot and without a lock — or none, when the writer knows those
rows from its last reads and writes (``_Known``) —; ``rules.plan`` on them; then ONE write
(data-modifying CTEs over each table's rows as JSON) that first locks the rows it changes, in the one
global lock order — reservations by request id, then key windows, then accounts by id, the platform
account last — and checks them: the reservations it closes still open, the key windows it sets as
read, and every pocket it takes money from able to give it without going below 0. It writes
nothing unless all hold; a row it creates that exists by then (a reservation, key window or usage
row) fails it whole. Accounts are moved by addition, each new entry's ``balance_after`` shifted by
what other transactions moved its account by since the read, so a payer's or a payee's row shared by
every coordinator is held only from one batch's write to its commit, and a batch of another
coordinator that moved it meanwhile is no conflict — nor a known row that is stale by such moves.
(Refusals — insufficient funds, a spend cap, an exclusive request's charge its balance cannot
cover — are decided on a read, never on known rows: a batch may refuse what a moment later it would
have taken.)

A batch planned on known rows whose write found a check failing, or that would refuse a step, is
read and planned again. One planned on a read whose write found a check failing — another
coordinator's batch got there first — is done again as one transaction: BEGIN, the same read with
``SELECT … FOR NO KEY UPDATE`` (all but the platform's row, which the write locks last), the plan,
the same write (its checks then hold), COMMIT. Every batch takes its row locks before it inserts
anything, in the same order; the one lock an insert takes — a new row's foreign key holding its
account ``FOR KEY SHARE``, an account the batch may not move, such as a free request's caller —
does not conflict with ``FOR NO KEY UPDATE``, so it waits for no other batch; and a batch waiting at an
insert (two batches creating one key window) waits for a batch past its locks. No wait closes a
cycle. (The rules stay in Python, shared with SQLite, not in a server-side function.)"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import asyncpg
from prometheus_client import Counter
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from darkbloom.coordinator.money.ledger import rules
from darkbloom.coordinator.money.ledger.rules import Changes, State, Step
from darkbloom.store.schema import FALLBACK_PREFIX, PLATFORM_ACCOUNT_ID
from darkbloom.wire.json_codec import dumps_text

# One statement reads everything a batch touches: reservations, then key windows, then accounts (the
# platform's last), each part's rows sorted — under the locks of the locked read, in the one global lock
# order. The windows (spend cap and fallback budget) and accounts of the reservations being closed come
# from those reservations themselves. The platform's row is never locked here (module docstring).
_READ = """
SELECT 'r' AS part, request_id AS id, account_id, key_id, amount_micro_usd AS n1, window_start AS n2,
       fallback_window_start AS n3, status, instance_id
FROM (SELECT * FROM reservations WHERE request_id = ANY($1::text[]) ORDER BY request_id {lock}) r
UNION ALL
SELECT 'w', NULL, NULL, key_id, window_start, spent_micro_usd, reserved_micro_usd, NULL, NULL
FROM (SELECT * FROM key_spend
      WHERE (key_id, window_start) IN (SELECT * FROM unnest($2::text[], $3::bigint[])
                                       UNION SELECT key_id, window_start FROM reservations
                                       WHERE request_id = ANY($1::text[]) AND window_start IS NOT NULL
                                       UNION SELECT $6::text || key_id, fallback_window_start FROM reservations
                                       WHERE request_id = ANY($1::text[]) AND fallback_window_start IS NOT NULL)
      ORDER BY key_id, window_start {lock}) w
UNION ALL
SELECT 'a', id, NULL, NULL, balance_micro_usd, withdrawable_micro_usd, NULL, NULL, NULL
FROM (SELECT * FROM accounts
      WHERE id IN (SELECT unnest($4::text[])
                   UNION SELECT account_id FROM reservations WHERE request_id = ANY($1::text[]))
        AND id <> $7::text
      ORDER BY id {lock}) a
UNION ALL
SELECT 'a', id, NULL, NULL, balance_micro_usd, withdrawable_micro_usd, NULL, NULL, NULL
FROM accounts WHERE id = $7::text
UNION ALL
SELECT 'u', request_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM usage_records WHERE request_id = ANY($5::text[])"""
_SNAPSHOT, _LOCKED = _READ.format(lock=""), _READ.format(lock="FOR NO KEY UPDATE")
# One statement writes everything, each table's rows as one JSON array (one parameter per table, typed
# by json_populate_recordset from the table, where one array parameter per column cost asyncpg more
# encoding; bench/RESULTS.md). First it locks, in the global order, the rows it changes and checks them: the
# reservations it closes still open ($8), the windows it sets as read ($9), and each account it moves
# ($1: what it adds to each pocket, the pockets as read, and the lowest the batch takes each below
# that) able to give what it takes without a pocket going below 0 (a pocket it only adds to is not
# checked). It writes nothing unless every check holds. Accounts are moved by addition, and a new
# entry's ``balance_after`` (planned from the read) is shifted by what other transactions moved its
# account by since the read.
_WRITE = """
WITH
cr AS (SELECT request_id FROM reservations WHERE request_id = ANY($8::text[]) AND status = 'open'
       ORDER BY request_id FOR NO KEY UPDATE),
cw AS (SELECT t.key_id FROM key_spend AS t JOIN json_populate_recordset(NULL::key_spend, $9::json) AS e
         ON t.key_id = e.key_id AND t.window_start = e.window_start
            AND t.spent_micro_usd = e.spent_micro_usd AND t.reserved_micro_usd = e.reserved_micro_usd
       WHERE (SELECT count(*) FROM cr) = cardinality($8::text[])
       ORDER BY t.key_id, t.window_start FOR NO KEY UPDATE OF t),
ca AS (SELECT t.id, v.db, v.dw, t.balance_micro_usd - v.rb AS sb, t.withdrawable_micro_usd - v.rw AS sw,
              (v.lb = 0 OR t.balance_micro_usd + v.lb >= 0)
              AND (v.lw = 0 OR t.withdrawable_micro_usd + v.lw >= 0) AS fits
       FROM accounts AS t
       JOIN json_to_recordset($1::json) AS v(id text, db bigint, dw bigint, rb bigint, rw bigint, lb bigint, lw bigint)
         ON t.id = v.id
       WHERE (SELECT count(*) FROM cw) = json_array_length($9::json)
       ORDER BY t.id = $10::text, t.id FOR NO KEY UPDATE OF t),
ok AS (SELECT (SELECT count(*) FROM cr) = cardinality($8::text[])
              AND (SELECT count(*) FROM cw) = json_array_length($9::json)
              AND (SELECT count(*) FILTER (WHERE fits) FROM ca) = json_array_length($1::json) AS ok),
a AS (UPDATE accounts AS t
      SET balance_micro_usd = t.balance_micro_usd + c.db, withdrawable_micro_usd = t.withdrawable_micro_usd + c.dw
      FROM ca AS c WHERE t.id = c.id AND (SELECT ok FROM ok)
      RETURNING t.id, t.balance_micro_usd, t.withdrawable_micro_usd),
kn AS (INSERT INTO key_spend (key_id, window_start, spent_micro_usd, reserved_micro_usd)
       SELECT key_id, window_start, spent_micro_usd, reserved_micro_usd
       FROM json_populate_recordset(NULL::key_spend, $2::json) WHERE (SELECT ok FROM ok)),
ku AS (UPDATE key_spend AS t SET spent_micro_usd = v.spent_micro_usd, reserved_micro_usd = v.reserved_micro_usd
       FROM json_populate_recordset(NULL::key_spend, $3::json) AS v
       WHERE t.key_id = v.key_id AND t.window_start = v.window_start AND (SELECT ok FROM ok)),
rn AS (INSERT INTO reservations (request_id, account_id, key_id, amount_micro_usd, window_start, status,
                                 instance_id, created_at, closed_at, fallback_window_start)
       SELECT request_id, account_id, key_id, amount_micro_usd, window_start, status, instance_id, created_at,
              closed_at, fallback_window_start
       FROM json_populate_recordset(NULL::reservations, $4::json) WHERE (SELECT ok FROM ok)),
rc AS (UPDATE reservations AS t SET status = v.status, closed_at = $11::bigint
       FROM json_populate_recordset(NULL::reservations, $5::json) AS v
       WHERE t.request_id = v.request_id AND (SELECT ok FROM ok)),
le AS (INSERT INTO ledger_entries (account_id, kind, pocket, amount_micro_usd, balance_after, request_id,
                                   created_at)
       SELECT v.account_id, v.kind, v.pocket, v.amount_micro_usd,
              v.balance_after + CASE WHEN v.pocket = 'balance' THEN s.sb ELSE s.sw END, v.request_id, $11::bigint
       FROM json_populate_recordset(NULL::ledger_entries, $6::json) WITH ORDINALITY AS v JOIN ca AS s
         ON s.id = v.account_id
       WHERE (SELECT ok FROM ok) ORDER BY v.ordinality),
u AS (INSERT INTO usage_records (request_id, account_id, key_id, model, provider_id, provider_account_id,
                                 prompt_tokens, completion_tokens, cost_micro_usd, platform_fee_micro_usd,
                                 provider_payout_micro_usd, self_routed, routed, created_at, ownership_changed,
                                 share_id, machine_id, batch_id, custom_id)
      SELECT request_id, account_id, key_id, model, provider_id, provider_account_id, prompt_tokens,
             completion_tokens, cost_micro_usd, platform_fee_micro_usd, provider_payout_micro_usd, self_routed, routed,
             created_at, ownership_changed, share_id, machine_id, batch_id, custom_id
      FROM json_populate_recordset(NULL::usage_records, $7::json) WHERE (SELECT ok FROM ok))
SELECT (SELECT ok FROM ok) AS ok,
       (SELECT json_agg(json_build_array(id, balance_micro_usd, withdrawable_micro_usd)) FROM a)::text AS moved"""
# The ledger's connection runs only these two statements, whose every row is found by its key: planned
# once per connection (a plan per batch cost the server 0.3–1 ms a statement), with index lookups and
# nested loops whatever the tables' sizes when it was planned.
_SESSION = ("SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; SET enable_hashjoin = off; "
            "SET enable_mergejoin = off")


BATCHES = Counter("darkbloom_ledger_batches_total",
                  "Postgres ledger batches written, by what they were planned on: known rows (the write alone), "
                  "a read, or a read under locks after the write's checks failed on a read", ["plan"])
_PLANNED = {plan: BATCHES.labels(plan) for plan in ("known", "read", "locked")}  # each batch counts one


class PostgresLedger:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None
        self._raw: Any = None
        self._known = _Known()

    async def _connection(self) -> Any:
        if self._raw is None or self._raw.is_closed():
            await self._discard()
            self._conn = await self._engine.connect()
            self._raw = (await self._conn.get_raw_connection()).driver_connection
            await self._raw.execute(_SESSION)
        return self._raw

    async def _discard(self) -> None:
        conn, self._conn, self._raw = self._conn, None, None
        if conn is not None:
            try:
                await conn.invalidate()
                await conn.close()
            except Exception:  # noqa: BLE001 - the connection is gone either way
                pass

    def apply_now(self, steps: list[Step]) -> list[Any] | None:
        return None  # a round trip to the server: always awaited on the loop

    async def apply(self, steps: list[Step]) -> list[Any]:
        raw = await self._connection()
        try:
            known = self._known.state_for(steps)
            if known is not None:
                results = await self._plan_and_write(raw, steps, known, taken_only=True)
                if results is not None:
                    _PLANNED["known"].inc()
                    return results
            results = await self._plan_and_write(raw, steps, await self._read(raw, steps, _SNAPSHOT))
            if results is not None:
                _PLANNED["read"].inc()
                return results
            async with raw.transaction():
                results = await self._plan_and_write(raw, steps, await self._read(raw, steps, _LOCKED))
            if results is None:
                raise LookupError("the ledger batch failed its checks under its own locks: "
                                  "an account it moves is missing")
            _PLANNED["locked"].inc()
        except BaseException:
            if raw.is_closed() or raw.is_in_transaction():
                await self._discard()  # broken, or a cancelled transaction left half-open
            raise
        return results

    async def close(self) -> None:
        conn, raw, self._conn, self._raw = self._conn, self._raw, None, None
        if conn is not None:
            try:
                if raw is not None and not raw.is_closed():
                    await raw.execute("RESET ALL")  # back to the pool as it came
            except Exception:  # noqa: BLE001 - then not back to the pool with the ledger's settings
                await conn.invalidate()
            await conn.close()

    async def _read(self, raw: Any, steps: list[Step], statement: str) -> State:
        state = await _read_rows(raw, steps, statement)
        self._known.saw(state)
        return state

    async def _plan_and_write(self, raw: Any, steps: list[Step], state: State,
                              taken_only: bool = False) -> list[Any] | None:
        """Plan the steps on ``state`` and write: their results, or None when the write's checks failed
        and it wrote nothing (under the locked read: only when an account is missing) — or, with
        ``taken_only``, when a step would be refused or finds nothing to close (which known rows are
        not the last word on; a read is)."""
        read = _Read(state)
        results, changes = rules.plan(steps, state, int(time.time()))
        if taken_only and not all(map(_taken, results)):
            return None
        if changes.empty():
            return results
        try:
            row = await raw.fetchrow(_WRITE, *_columns(changes, read))
        except asyncpg.UniqueViolationError:  # a reservation, key window or usage row made since the read
            if raw.is_in_transaction():
                raise  # under locks: two replicas creating one key window; the batch is retried whole
            return None
        if not row["ok"]:
            return None
        self._known.wrote(changes, json.loads(row["moved"] or "[]"))
        return results


async def _read_rows(raw: Any, steps: list[Step], statement: str) -> State:
    """One round trip: the rows the batch needs (its reservations' own windows and accounts included)."""
    state = State()
    reserving = rules.window_keys(steps, {})
    rows = await raw.fetch(statement,
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


class _Read:
    """The values of the windows and accounts as read, before ``rules.plan`` moves them."""

    def __init__(self, state: State) -> None:
        self.windows = {key: tuple(values) for key, values in state.windows.items()}
        self.accounts = {key: tuple(values) for key, values in state.accounts.items()}


def _taken(result: Any) -> bool:
    """A step's result that no fresher row could change: a reservation made, a settlement that
    collected all it charged, a refund given."""
    return result == rules.RESERVED or result is True or (isinstance(result, rules.Settled) and not result.uncollected)


class _Known:
    """Rows as this coordinator last read or wrote them, to plan a batch on without a read: accounts
    (stale by whatever others moved since — the write adds and checks, so that costs nothing but a
    refusal, and a refusal is never decided on them) and the open reservations it read or made. A
    batch that needs any other row, or a key window, is planned on a read. The least recently used go
    first."""

    LIMIT = 10_000  # rows of each kind

    def __init__(self) -> None:
        self.accounts: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self.reservations: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def state_for(self, steps: list[Step]) -> State | None:
        state = State()
        reserving = {step.request_id for step in steps if isinstance(step, rules.Reserve)}
        for step in steps:
            if isinstance(step, rules.Reserve):  # one already known open (a reused id): as a read says
                if step.cap is not None or step.fallback_cap is not None or step.request_id in self.reservations:
                    return None
            elif not isinstance(step, rules.Settle) or step.reserved:
                row = self.reservations.get(step.request_id)
                if row is None:
                    if step.request_id in reserving:  # made earlier in this batch
                        continue
                    return None
                if row["window_start"] is not None or row["fallback_window_start"] is not None:
                    return None
                state.reservations[step.request_id] = dict(row)
        for account_id in rules.account_ids(steps, state.reservations):
            values = self.accounts.get(account_id)
            if values is None:
                return None
            state.accounts[account_id] = list(values)
        return state

    def saw(self, state: State) -> None:
        """What a read found (before the plan moves it)."""
        for account_id, values in state.accounts.items():
            self._put(self.accounts, account_id, (values[0], values[1]))
        for request_id, row in state.reservations.items():
            if row["status"] == "open":
                self._put(self.reservations, request_id, dict(row))
            else:
                self.reservations.pop(request_id, None)

    def wrote(self, changes: Changes, moved: list[list[Any]]) -> None:
        """What a write left: the accounts' pockets after it, the reservations it opened and closed."""
        for account_id, balance, withdrawable in moved:
            self._put(self.accounts, account_id, (int(balance), int(withdrawable)))
        for request_id, row in changes.new_reservations.items():
            if row["status"] == "open":
                self._put(self.reservations, request_id, dict(row))
        for request_id in changes.closed:
            self.reservations.pop(request_id, None)

    def _put(self, rows: collections.OrderedDict[str, Any], key: str, value: Any) -> None:
        rows[key] = value
        rows.move_to_end(key)
        if len(rows) > self.LIMIT:
            rows.popitem(last=False)


def _columns(changes: Changes, read: _Read) -> list[Any]:
    """The write statement's arguments: each table's rows as JSON ($1 … $7: each account as what it
    gains, read and lowest), what it checks first ($8, $9), the platform's id ($10), the time ($11)."""
    lowest: dict[tuple[str, str], int] = {}  # (account, pocket): the lowest the batch takes it below the read
    for account_id, _, pocket, _, after, _ in changes.entries:
        before = read.accounts[account_id][0 if pocket == "balance" else 1]
        lowest[account_id, pocket] = min(lowest.get((account_id, pocket), 0), after - before)

    def windows(new: bool) -> str:
        return dumps_text([{"key_id": key[0], "window_start": key[1], "spent_micro_usd": values[0],
                            "reserved_micro_usd": values[1]}
                           for key, values in changes.windows.items() if (key in changes.new_windows) == new])

    return [
        dumps_text([{"id": k, "db": v[0] - read.accounts[k][0], "dw": v[1] - read.accounts[k][1],
                     "rb": read.accounts[k][0], "rw": read.accounts[k][1],
                     "lb": lowest.get((k, "balance"), 0), "lw": lowest.get((k, "withdrawable"), 0)}
                    for k, v in changes.accounts.items()]),
        windows(True), windows(False),
        dumps_text(list(changes.new_reservations.values())),
        dumps_text([{"request_id": r, "status": status} for r, status in changes.closed.items()]),
        dumps_text([dict(zip(rules.ENTRY_COLUMNS, entry)) for entry in changes.entries]),
        dumps_text([dict(zip(rules.USAGE_COLUMNS, row)) for row in changes.usage]),
        sorted(changes.closed),
        dumps_text([{"key_id": k[0], "window_start": k[1], "spent_micro_usd": read.windows[k][0],
                     "reserved_micro_usd": read.windows[k][1]}
                    for k in changes.windows if k not in changes.new_windows]),
        PLATFORM_ACCOUNT_ID, changes.now,
    ]
