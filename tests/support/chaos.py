"""The spenders of the chaos money runs (tests/reliability/test_chaos_money.py on one coordinator,
test_chaos_money_replicas.py across three replicas), made over HTTP as a user would:

- ``public``: a funded account on public routing with an uncapped key;
- ``capped``: a funded account whose key has a small hard cap (some requests: 402 spend_cap_exceeded);
- ``poor``: an account credited a few requests' worth (some requests: 402 insufficient_funds);
- ``prefer``: a funded account that owns a provider and sends ``X-Darkbloom-Route: prefer``;
- ``exclusive``/``exclusive-key``: an account with no money that owns a provider, by header
  (``X-Darkbloom-Route: self``) and by a ``self_route_only`` key.

Also the plan of requests drawn among them, and a client per spender that carries its route header.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from tests.coordinator.money.test_conservation import Outcome, Spender
from tests.support.accounts import Account
from tests.support.billing import credit, new_key, signup
from tests.support.processes import Coordinator

CAP = 5_000               # µUSD: the capped key's hard limit (a handful of requests)
POOR = 5_000              # µUSD: what the poor account is credited
ROUTE = "X-Darkbloom-Route"
# µUSD each account is credited, in the order they are made
CREDITS = {"public": 5_000_000, "capped": 1_000_000, "poor": POOR, "prefer": 2_000_000, "exclusive": 0}
# each spender: the account whose key it is, and the key's fields
KEYS: dict[str, tuple[str, dict[str, Any]]] = {
    "public": ("public", {}),
    "capped": ("capped", {"limit_usd": CAP / 1_000_000, "limit_reset": "none"}),
    "poor": ("poor", {}),
    "prefer": ("prefer", {}),
    "exclusive": ("exclusive", {}),
    "exclusive-key": ("exclusive", {"self_route_only": True}),
}
WEIGHTS = {"public": 4, "capped": 1, "poor": 1, "prefer": 3, "exclusive": 1, "exclusive-key": 1}
ROUTES = {"prefer": {ROUTE: "prefer"}, "exclusive": {ROUTE: "self"}}

O = TypeVar("O", bound=Outcome)


@dataclass
class ChaosAccounts:
    accounts: dict[str, Account]  # the five accounts by name (their sessions link their machines)
    spenders: dict[str, Spender]  # the six keys by name
    credited: int                 # µUSD credited to the accounts in all


def chaos_accounts(coordinators: Sequence[Coordinator]) -> ChaosAccounts:
    """The five accounts signed up and credited, then their six keys made, each step through the next
    of ``coordinators`` in turn (one database behind them all)."""
    accounts: dict[str, Account] = {}
    credited = 0
    for index, (name, amount) in enumerate(CREDITS.items()):
        coord = coordinators[index % len(coordinators)]
        account_id, session = signup(coord)
        if amount:
            assert credit(coord, account_id, amount, f"chaos-{account_id}").status_code == 200
            credited += amount
        accounts[name] = Account(account_id, session, "", "")
    spenders: dict[str, Spender] = {}
    for index, (name, (owner, fields)) in enumerate(KEYS.items()):
        key = new_key(coordinators[index % len(coordinators)], accounts[owner].session, **fields)
        spenders[name] = Spender(name, accounts[owner].account_id, key["key"], key["id"],
                                 CAP if "limit_usd" in fields else None)
    return ChaosAccounts(accounts, spenders, credited)


def chaos_plan(rng: random.Random, spenders: list[Spender], count: int,
               outcome: Callable[[str, bool, bool], O]) -> list[tuple[Spender, O]]:
    """``count`` requests drawn among ``spenders`` by WEIGHTS, each with the outcome it will fill in
    (``outcome(spender, stream, walk_away)``): half of them streamed, some walked away from (a stream
    dropped after its first content, a plain request whose client times out)."""
    plan = []
    for _ in range(count):
        spender = rng.choices(spenders, [WEIGHTS[s.name] for s in spenders])[0]
        stream = rng.random() < 0.5
        walk_away = rng.random() < (0.2 if stream else 0.06)
        plan.append((spender, outcome(spender.name, stream, walk_away)))
    return plan


def route_clients(names: Iterable[str]) -> dict[str, httpx.AsyncClient]:
    """A client for each spender named, sending its route header (``prefer``, ``self`` for ``exclusive``),
    with no limit on connections."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return {name: httpx.AsyncClient(limits=limits, headers=ROUTES.get(name, {})) for name in names}
