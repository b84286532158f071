"""The money rules of one batch, as a pure function: the ledger writer reads (and locks) the rows a
batch touches into a ``State``, ``plan`` applies the batch's steps to it in arrival order and
returns each step's result plus the row changes to write, and the writer writes them in the same
transaction. No I/O here, so SQLite and Postgres share every rule.

Steps: ``Reserve`` (a prefer request's fallback budget, then key cap, then balance, each checked
against the state left by the steps before it), ``Settle`` (close the reservation once: refund the
hold, charge, fee, payout, key windows, usage row; or, without a reservation, charge straight from
the balance), ``Refund`` (close the reservation once, give the hold back). A refused or repeated
step changes nothing and is a result for its caller only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Union

from darkbloom.store.schema import FALLBACK_PREFIX, PLATFORM_ACCOUNT_ID

RESERVED = "reserved"
SPEND_CAP_EXCEEDED = "spend_cap_exceeded"
INSUFFICIENT_FUNDS = "insufficient_funds"
DUPLICATE = "duplicate"  # the request id already has a different reservation
FALLBACK_EXHAUSTED = "fallback_exhausted"  # prefer: the key's fallback budget cannot hold it (nothing taken)


@dataclass(frozen=True)
class Reserve:
    request_id: str
    account_id: str
    key_id: str | None
    amount: int
    cap: int | None          # the key's spend cap, when it has one
    window_start: int | None  # the cap's current window (None without a cap)
    instance_id: str
    fallback_cap: int | None = None    # prefer on a key with a fallback budget: what the public fleet may take
    fallback_window: int | None = None  # that budget's current window (None without one)


@dataclass(frozen=True)
class Settle:
    request_id: str
    account_id: str
    key_id: str | None
    model: str
    provider_id: str
    provider_account_id: str | None
    prompt_tokens: int
    completion_tokens: int
    cost: int                # what the caller owes (0 when free); never more than the reservation
    fee_bps: int
    reserved: bool           # closes an open reservation; False: exclusive, charged from the balance
    self_routed: bool        # free on the caller's own machine (the usage row's flag)
    routed: str              # owned | shared | fleet
    ownership_changed: bool = False  # exclusive, but the machine changed owner mid-flight (still free)
    share_id: str | None = None      # routed through this share (free, or charged at its prices)
    machine_id: str | None = None    # the serving session's machine (mach_…), for machine insight
    batch_id: str | None = None      # a batch line's request: its batch and the line's custom_id
    custom_id: str | None = None


@dataclass(frozen=True)
class Refund:
    request_id: str


Step = Union[Reserve, Settle, Refund]


def must_reach_disk(steps: Iterable[Step]) -> bool:
    """Whether a batch's commit must be on disk before its callers hear of it: when it charges a
    caller (a settlement whose cost is above 0), since the answer that reports the charge follows.
    Whatever else a system crash rolls back leaves the balances as they would be after the restart's
    reconciliation: a reservation rolled back never held anything (the crash ended its request); a
    refund or a free settlement rolled back leaves its reservation open, and the reconciler gives that
    back; a free request's usage row is its only loss. A batch that does wait for the disk takes every
    earlier commit there with it (SQLite's write-ahead log is written in order)."""
    return any(isinstance(step, Settle) and step.cost > 0 for step in steps)


@dataclass(frozen=True)
class Settled:
    cost: int                # collected from the caller
    platform_fee: int
    payout: int
    uncollected: int = 0     # an exclusive request's charge the balance could not cover


@dataclass
class State:
    """The rows a batch reads, as they are when its transaction holds their locks."""

    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)
    windows: dict[tuple[str, int], list[int]] = field(default_factory=dict)   # [spent, reserved]
    accounts: dict[str, list[int]] = field(default_factory=dict)              # [balance, withdrawable]
    used: set[str] = field(default_factory=set)   # request ids that already have a usage row


ENTRY_COLUMNS = ("account_id", "kind", "pocket", "amount_micro_usd", "balance_after", "request_id")
USAGE_COLUMNS = ("request_id", "account_id", "key_id", "model", "provider_id", "provider_account_id", "prompt_tokens",
                 "completion_tokens", "cost_micro_usd", "platform_fee_micro_usd", "provider_payout_micro_usd",
                 "self_routed", "routed", "created_at", "ownership_changed", "share_id", "machine_id", "batch_id",
                 "custom_id")


@dataclass
class Changes:
    """What ``plan`` leaves to write: final values of the touched rows, and the new rows in order
    (``entries`` and ``usage`` rows hold the columns ENTRY_COLUMNS and USAGE_COLUMNS name)."""

    now: int
    accounts: dict[str, list[int]] = field(default_factory=dict)
    windows: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    new_windows: set[tuple[str, int]] = field(default_factory=set)
    new_reservations: dict[str, dict[str, Any]] = field(default_factory=dict)
    closed: dict[str, str] = field(default_factory=dict)   # existing reservation → settled | refunded
    entries: list[tuple[str, str, str, int, int, str]] = field(default_factory=list)
    usage: list[tuple[Any, ...]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.accounts or self.windows or self.new_reservations or self.closed or self.usage)


def fallback_scope(key_id: str) -> str:
    """The key_spend row name of a key's fallback budget (its spend cap's row is the key id)."""
    return FALLBACK_PREFIX + key_id


def _windows_of(row: dict[str, Any]) -> list[tuple[str, int]]:
    """The key windows an open reservation holds its amount against: the spend cap's, the fallback budget's."""
    held = []
    if row["key_id"] and row["window_start"] is not None:
        held.append((row["key_id"], int(row["window_start"])))
    if row["key_id"] and row.get("fallback_window_start") is not None:
        held.append((fallback_scope(row["key_id"]), int(row["fallback_window_start"])))
    return held


def _reserving(step: "Reserve") -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    cap = (step.key_id, step.window_start) if step.cap is not None and step.key_id else None
    fallback = (fallback_scope(step.key_id), step.fallback_window) if (
        step.fallback_cap is not None and step.key_id and step.fallback_window is not None) else None
    return cap, fallback  # type: ignore[return-value]


# what to read, in the lock order: reservations, then key windows, then accounts

def reservation_ids(steps: Iterable[Step]) -> list[str]:
    return sorted({s.request_id for s in steps if not isinstance(s, Settle) or s.reserved})


def window_keys(steps: Iterable[Step], reservations: dict[str, dict[str, Any]]) -> list[tuple[str, int]]:
    keys = {window for s in steps if isinstance(s, Reserve) for window in _reserving(s) if window is not None}
    keys |= {window for r in reservations.values() for window in _windows_of(r)}
    return sorted(keys)


def account_ids(steps: Iterable[Step], reservations: dict[str, dict[str, Any]]) -> list[str]:
    ids = {PLATFORM_ACCOUNT_ID}
    for step in steps:
        if isinstance(step, Settle):
            ids.add(step.account_id)
            if step.provider_account_id:
                ids.add(step.provider_account_id)
        elif isinstance(step, Reserve):
            ids.add(step.account_id)
    ids |= {r["account_id"] for r in reservations.values()}
    return sorted(ids)


def usage_ids(steps: Iterable[Step]) -> list[str]:
    return sorted({s.request_id for s in steps if isinstance(s, Settle) and not s.reserved})


def plan(steps: list[Step], state: State, now: int) -> tuple[list[Any], Changes]:
    """Each step's result (in order) and the changes that make them true."""
    planner = _Planner(state, Changes(now))
    return [planner.apply(step) for step in steps], planner.changes


class _Planner:
    def __init__(self, state: State, changes: Changes) -> None:
        self.state, self.changes = state, changes

    def apply(self, step: Step) -> Any:
        if isinstance(step, Reserve):
            return self._reserve(step)
        if isinstance(step, Settle):
            return self._settle(step)
        return self._refund(step.request_id)

    def _move(self, account_id: str, pocket: str, amount: int, kind: str, request_id: str) -> None:
        values = self.state.accounts[account_id]
        index = 0 if pocket == "balance" else 1
        values[index] += amount
        self.changes.accounts[account_id] = values
        self.changes.entries.append((account_id, kind, pocket, amount, values[index], request_id))

    def _window(self, key: tuple[str, int]) -> list[int]:
        window = self.state.windows.get(key)
        if window is None:
            window = self.state.windows[key] = [0, 0]
            self.changes.new_windows.add(key)
        self.changes.windows[key] = window
        return window

    def _reserve(self, step: Reserve) -> str:
        existing = self.state.reservations.get(step.request_id)
        if existing is not None:  # a retried batch whose first commit did land, or a reused id
            same = (existing["status"] == "open" and existing["account_id"] == step.account_id
                    and int(existing["amount_micro_usd"]) == step.amount
                    and existing["instance_id"] == step.instance_id)
            return RESERVED if same else DUPLICATE
        key, fallback = _reserving(step)
        if fallback is not None and not self._holds(fallback, step.fallback_cap, step.amount):
            return FALLBACK_EXHAUSTED  # first: the request then goes as exclusive, never capped nor charged
        if key is not None and not self._holds(key, step.cap, step.amount):
            return SPEND_CAP_EXCEEDED
        account = self.state.accounts.get(step.account_id)
        if account is None or account[0] < step.amount:
            return INSUFFICIENT_FUNDS
        for window in (key, fallback):
            if window is not None:
                self._window(window)[1] += step.amount
        self._move(step.account_id, "balance", -step.amount, "reservation", step.request_id)
        row = {"request_id": step.request_id, "account_id": step.account_id, "key_id": step.key_id,
               "amount_micro_usd": step.amount, "window_start": key[1] if key else None, "status": "open",
               "instance_id": step.instance_id, "created_at": self.changes.now, "closed_at": None,
               "fallback_window_start": fallback[1] if fallback else None}
        self.state.reservations[step.request_id] = row
        self.changes.new_reservations[step.request_id] = row
        return RESERVED

    def _holds(self, window: tuple[str, int], cap: int | None, amount: int) -> bool:
        spent, held = self.state.windows.get(window, (0, 0))
        return spent + held + amount <= (cap or 0)

    def _close(self, request_id: str, status: str) -> dict[str, Any] | None:
        """open → settled | refunded, once; the reservation, its key window released."""
        row = self.state.reservations.get(request_id)
        if row is None or row["status"] != "open":
            return None
        row["status"] = status
        if request_id in self.changes.new_reservations:
            row["closed_at"] = self.changes.now
        else:
            self.changes.closed[request_id] = status
        return row

    def _release(self, row: dict[str, Any], spent: int) -> None:
        for key in _windows_of(row):
            window = self._window(key)
            window[0] += spent
            window[1] -= int(row["amount_micro_usd"])

    def _refund(self, request_id: str) -> bool:
        row = self._close(request_id, "refunded")
        if row is None:
            return False
        self._release(row, 0)
        self._move(row["account_id"], "balance", int(row["amount_micro_usd"]), "refund", request_id)
        return True

    def _settle(self, step: Settle) -> Settled | None:
        request_id, uncollected = step.request_id, 0
        if step.reserved:
            row = self._close(request_id, "settled")
            if row is None:
                return None
            held = int(row["amount_micro_usd"])
            collected = min(step.cost, held)
            self._release(row, collected)
            self._move(row["account_id"], "balance", held, "refund", request_id)
            if collected:
                self._move(row["account_id"], "balance", -collected, "charge", request_id)
        else:
            if request_id in self.state.used:
                return None
            collected = step.cost
            account = self.state.accounts.get(step.account_id)
            if collected and (account is None or account[0] < collected):
                uncollected, collected = collected, 0
            elif collected:
                self._move(step.account_id, "balance", -collected, "charge", request_id)
        fee = collected * step.fee_bps // 10_000
        payout = collected - fee
        payee = step.provider_account_id or PLATFORM_ACCOUNT_ID
        if payee not in self.state.accounts:
            payee = PLATFORM_ACCOUNT_ID  # a deleted owner: the share stays with the platform, not lost
        if fee:
            self._move(PLATFORM_ACCOUNT_ID, "withdrawable", fee, "platform_fee", request_id)
        if payout:
            self._move(payee, "withdrawable", payout, "payout", request_id)
        self.state.used.add(request_id)
        self.changes.usage.append((
            request_id, step.account_id, step.key_id, step.model, step.provider_id, step.provider_account_id,
            step.prompt_tokens, step.completion_tokens, collected, fee, payout, step.self_routed, step.routed,
            self.changes.now, step.ownership_changed, step.share_id, step.machine_id, step.batch_id, step.custom_id))
        return Settled(collected, fee, payout, uncollected)
