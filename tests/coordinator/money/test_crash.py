"""A coordinator killed (SIGKILL) with reservations open: restarted on the same database, it refunds
them exactly — balance and key window restored — and logs each reconciliation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from darkbloom.store.schema import key_spend, ledger_entries, reservations, usage_records

from tests.support.processes import start_fixed_upstream
from tests.support.databases import database_for
from tests.support.billing import (billing_coordinator, credit, new_key, node_home, open_reservations,
                                   pockets, signup, start_serve, table, wait_registered,
                                   write_catalog)
from tests.support.processes import start_coordinator, wait_until

pytestmark = pytest.mark.e2e

MODEL = "fixed-model"
STALE_AFTER = 2


def fire(url: str, key: str, stream: bool, max_tokens: int, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            httpx.post(url + "/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
                "model": MODEL, "stream": stream, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "a slow answer, please"}]})
        except httpx.HTTPError as exc:  # the coordinator dies under it
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("restart", ["at_once", "after_stale"])
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_reservations_left_open_by_a_crash_are_refunded_after_restart(backend: str, restart: str,
                                                                      tmp_path: Path) -> None:
    processes = []
    with database_for(backend, tmp_path) as url:
        try:
            upstream, upstream_url = start_fixed_upstream(tmp_path / "upstream", "--first-delay", "60")
            processes.append(upstream)
            catalog = write_catalog(tmp_path / "catalog.json", {"id": MODEL, "input_price": 1_333_333,
                                                                "output_price": 4_666_667, "max_output_tokens": 64})
            args = ("--instance-stale-after", str(STALE_AFTER), "--first-content-timeout", "120")
            coord = billing_coordinator(tmp_path / "coordinator", url, catalog, *args)
            processes.append(coord.process)
            account_id, session = signup(coord)
            assert credit(coord, account_id, 100_000, "crash-credit").status_code == 200
            capped = new_key(coord, session, limit_usd=0.05, limit_reset="daily")
            free = new_key(coord, session)
            node = start_serve(coord, node_home(tmp_path, "node"), "--backend", "openai", "--upstream-url",
                               upstream_url, "--model", MODEL, "--max-concurrency", "8")
            processes.append(node)
            wait_registered(node)

            errors: list[BaseException] = []
            threads = [fire(coord.api_url, capped["key"], False, 64, errors),
                       fire(coord.api_url, capped["key"], True, 16, errors),
                       fire(coord.api_url, free["key"], True, 32, errors)]
            held = wait_until(lambda: (r := open_reservations(url)) and len(r) == 3 and r, timeout=30,
                              what="three open reservations")
            total = sum(r["amount_micro_usd"] for r in held)
            on_key = sum(r["amount_micro_usd"] for r in held if r["key_id"] == capped["id"])
            assert pockets(url, account_id) == (100_000 - total, 0)
            [window] = table(url, key_spend, key_spend.c.key_id == capped["id"])
            assert (window["spent_micro_usd"], window["reserved_micro_usd"]) == (0, on_key) and on_key > 0
            crashed_instance = {r["instance_id"] for r in held}
            assert len(crashed_instance) == 1

            coord.process.kill()  # SIGKILL: no shutdown, no settlement, no refund
            for thread in threads:
                thread.join(timeout=30)
            assert len(errors) == 3  # every client saw its coordinator vanish
            assert len(open_reservations(url)) == 3  # nothing closed them on the way down
            if restart == "after_stale":
                time.sleep(STALE_AFTER + 1.5)

            restarted = start_coordinator(tmp_path / "coordinator", url, "--catalog", str(catalog), "--min-trust",
                                          "none", *args)
            processes.append(restarted.process)
            if restart == "after_stale":  # the crashed instance is already stale: reconciled during start-up
                assert open_reservations(url) == []
            wait_until(lambda: not open_reservations(url), timeout=20, interval=0.2, what="reconciliation")

            assert pockets(url, account_id) == (100_000, 0)
            [window] = table(url, key_spend, key_spend.c.key_id == capped["id"])
            assert (window["spent_micro_usd"], window["reserved_micro_usd"]) == (0, 0)
            for reservation in held:
                request_id = reservation["request_id"]
                [row] = table(url, reservations, reservations.c.request_id == request_id)
                assert row["status"] == "refunded"
                entries = sorted(table(url, ledger_entries, ledger_entries.c.request_id == request_id),
                                 key=lambda e: e["id"])
                assert [(e["kind"], e["amount_micro_usd"]) for e in entries] == [
                    ("reservation", -reservation["amount_micro_usd"]), ("refund", reservation["amount_micro_usd"])]
                assert table(url, usage_records, usage_records.c.request_id == request_id) == []
                log = restarted.process.log()
                assert f"reconciled reservation {request_id} ({reservation['amount_micro_usd']} µUSD) left open by " \
                       f"instance {next(iter(crashed_instance))}: refunded" in log
            # the account can spend its whole credit again, through the same capped key
            assert httpx.get(restarted.api_url + "/payments/balance",
                             headers={"Authorization": f"Bearer {capped['key']}"}).json() == {
                "balance_micro_usd": 100_000, "withdrawable_micro_usd": 0}
        finally:
            for process in reversed(processes):
                if process is processes[0]:
                    process.kill()  # the fake upstream would wait out its 60 s answers on a graceful stop
                else:
                    process.stop()
