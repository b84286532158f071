"""The ledger writer's SQLite side: one call into the writer's own thread applies a whole batch —
``BEGIN IMMEDIATE``, point reads of the rows it touches, ``rules.plan``, ``executemany`` writes,
``COMMIT`` — with prepared statements straight on a ``sqlite3`` connection (no SQLAlchemy, no hop
back to the event loop between statements). SQLite serialises writers, so the lock order is moot.

A batch that settles a charge is synced before its callers hear of it (``FULL``), so the charge is on
disk before the answer that reports it goes out; every other batch commits without waiting for the
disk (``synchronous=NORMAL``: safe from the process crashing, not from the system;
``rules.must_reach_disk`` says why that is enough).

Such a batch may instead be applied at once on the caller's thread (``apply_now``, which the writer
uses when its process serves one request and nothing else: the two hops to the writer's thread and
back are then a quarter of a free request's time in the coordinator after its last frame). It never
waits there: not for the disk (a charge; nor the write-ahead log's checkpoint, which SQLite runs in
the commit that fills the log: off for these commits, and after ``CHECKPOINT_EVERY`` of them the
next batch goes to the thread, which checkpoints), nor for another connection's write lock
(``busy_timeout`` 0 for that ``BEGIN``): in each case it says None and the batch goes to the thread
as any other."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from darkbloom.coordinator.money.ledger import rules
from darkbloom.coordinator.money.ledger.rules import Changes, State, Step

_RESERVATION = ("SELECT request_id, account_id, key_id, amount_micro_usd, window_start, status, instance_id, "
                "fallback_window_start FROM reservations WHERE request_id = ?")
_WINDOW = "SELECT spent_micro_usd, reserved_micro_usd FROM key_spend WHERE key_id = ? AND window_start = ?"
_ACCOUNT = "SELECT balance_micro_usd, withdrawable_micro_usd FROM accounts WHERE id = ?"
_USED = "SELECT 1 FROM usage_records WHERE request_id = ?"
CHECKPOINT_EVERY = 100  # commits on the caller's thread (one step, 10–20 pages of the log each) between checkpoints
# what a transaction on the caller's thread must never do: wait for another connection's lock, or
# checkpoint the log in its commit (with a sync); the writer's thread waits and checkpoints as SQLite does
_ON_CALLERS_THREAD = ("PRAGMA busy_timeout=0", "PRAGMA wal_autocheckpoint=0")
_ON_WRITERS_THREAD = ("PRAGMA busy_timeout=30000", "PRAGMA wal_autocheckpoint=1000")
_RESERVATION_COLUMNS = ("request_id", "account_id", "key_id", "amount_micro_usd", "window_start", "status",
                        "instance_id", "created_at", "closed_at", "fallback_window_start")


class SqliteLedger:
    def __init__(self, path: str) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = None
        self._synchronous = ""  # the connection's level now: FULL or NORMAL
        self._on_callers_thread = False  # the connection's settings now: _ON_CALLERS_THREAD's or the writer's
        self._commits_now = 0  # on the caller's thread since the writer's thread last checkpointed
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-writer")

    async def apply(self, steps: list[Step]) -> list[Any]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._apply, steps)

    def apply_now(self, steps: list[Step]) -> list[Any] | None:
        """The batch's results, applied on this thread when that cannot wait: None when it must reach
        the disk, a checkpoint is due, or another connection holds the write lock."""
        if rules.must_reach_disk(steps) or self._commits_now >= CHECKPOINT_EVERY:
            return None
        conn = self._connect()
        self._configure(conn, "NORMAL", on_callers_thread=True)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:  # locked: the writer's thread waits for it, this thread must not
            return None
        results = self._transaction(conn, steps)
        self._commits_now += 1
        return results

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close)
        self._thread.shutdown(wait=False)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._synchronous = ""
            self._on_callers_thread = False

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self._path, timeout=30, isolation_level=None, check_same_thread=False,
                                   cached_statements=64)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA busy_timeout=30000")
            self._conn = conn
        return self._conn

    def _configure(self, conn: sqlite3.Connection, synchronous: str, *, on_callers_thread: bool) -> None:
        """The connection's settings for the next transaction, each changed only when it differs (outside
        a transaction, where SQLite takes them)."""
        if synchronous != self._synchronous:
            conn.execute(f"PRAGMA synchronous={synchronous}")
            self._synchronous = synchronous
        if on_callers_thread != self._on_callers_thread:
            for pragma in _ON_CALLERS_THREAD if on_callers_thread else _ON_WRITERS_THREAD:
                conn.execute(pragma)
            self._on_callers_thread = on_callers_thread

    def _apply(self, steps: list[Step]) -> list[Any]:
        conn = self._connect()
        self._configure(conn, "FULL" if rules.must_reach_disk(steps) else "NORMAL", on_callers_thread=False)
        conn.execute("BEGIN IMMEDIATE")
        results = self._transaction(conn, steps)
        if self._commits_now >= CHECKPOINT_EVERY:  # what the commits on the caller's thread left
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # as SQLite's own would
            self._commits_now = 0
        return results

    def _transaction(self, conn: sqlite3.Connection, steps: list[Step]) -> list[Any]:
        """Read, plan, write and commit in the transaction just begun (rolled back on any error)."""
        try:
            state = _read(conn, steps)
            results, changes = rules.plan(steps, state, int(time.time()))
            _write(conn, changes)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return results


def _read(conn: sqlite3.Connection, steps: list[Step]) -> State:
    state = State()
    names = ("request_id", "account_id", "key_id", "amount_micro_usd", "window_start", "status", "instance_id",
             "fallback_window_start")
    for request_id in rules.reservation_ids(steps):
        row = conn.execute(_RESERVATION, (request_id,)).fetchone()
        if row is not None:
            state.reservations[request_id] = dict(zip(names, row))
    for key in rules.window_keys(steps, state.reservations):
        row = conn.execute(_WINDOW, key).fetchone()
        if row is not None:
            state.windows[key] = [int(row[0]), int(row[1])]
    for account_id in rules.account_ids(steps, state.reservations):
        row = conn.execute(_ACCOUNT, (account_id,)).fetchone()
        if row is not None:
            state.accounts[account_id] = [int(row[0]), int(row[1])]
    for request_id in rules.usage_ids(steps):
        if conn.execute(_USED, (request_id,)).fetchone() is not None:
            state.used.add(request_id)
    return state


def _write(conn: sqlite3.Connection, changes: Changes) -> None:
    if changes.accounts:
        conn.executemany("UPDATE accounts SET balance_micro_usd = ?, withdrawable_micro_usd = ? WHERE id = ?",
                         [(v[0], v[1], k) for k, v in changes.accounts.items()])
    new = [(k[0], k[1], v[0], v[1]) for k, v in changes.windows.items() if k in changes.new_windows]
    if new:
        conn.executemany("INSERT INTO key_spend (key_id, window_start, spent_micro_usd, reserved_micro_usd) "
                         "VALUES (?, ?, ?, ?)", new)
    changed = [(v[0], v[1], k[0], k[1]) for k, v in changes.windows.items() if k not in changes.new_windows]
    if changed:
        conn.executemany("UPDATE key_spend SET spent_micro_usd = ?, reserved_micro_usd = ? "
                         "WHERE key_id = ? AND window_start = ?", changed)
    if changes.new_reservations:
        conn.executemany(_insert("reservations", _RESERVATION_COLUMNS),
                         [tuple(r[c] for c in _RESERVATION_COLUMNS) for r in changes.new_reservations.values()])
    if changes.closed:
        conn.executemany("UPDATE reservations SET status = ?, closed_at = ? WHERE request_id = ?",
                         [(status, changes.now, rid) for rid, status in changes.closed.items()])
    if changes.entries:
        conn.executemany(_insert("ledger_entries", (*rules.ENTRY_COLUMNS, "created_at")),
                         [(*entry, changes.now) for entry in changes.entries])
    if changes.usage:
        conn.executemany(_insert("usage_records", rules.USAGE_COLUMNS), changes.usage)


def _insert(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
