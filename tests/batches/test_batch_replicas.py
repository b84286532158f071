"""A batch across two coordinator replicas (Postgres, Redis, NATS) when the one it was created on is
SIGKILLed mid-batch: the survivor takes its lines over when their leases run out, every line is
answered exactly once, and Σ line costs = Σ usage rows = the balance's drop."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from tests.batches.support import FAST, MODEL, PRICES, chat_line, file_lines, run_batch, sdk, wait_counts, wait_status
from tests.selfroute.support import Stack
from tests.support.billing import write_catalog
from tests.support.processes import start_fixed_upstream, wait_until
from tests.support.replicas import replica_set

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
LINES = 40


@pytest.fixture
def two_replicas(tmp_path: Path) -> Iterator[Stack]:
    catalog = write_catalog(tmp_path / "catalog.json", {"id": MODEL, **PRICES})
    with pytest.MonkeyPatch.context() as patch:
        for name, value in FAST.items():
            patch.setenv(name, value)
        with replica_set(tmp_path / "replicas", 2, "--catalog", str(catalog), "--min-trust", "none") as replicas:
            survivor, doomed = replicas.coordinators
            stack = Stack(tmp_path, survivor, consumer=doomed, machine_sides=[survivor])
            upstream_process, upstream = start_fixed_upstream(tmp_path / "upstream")
            stack.processes.append(upstream_process)
            stack.upstream = upstream  # type: ignore[attr-defined]
            try:
                yield stack
            finally:
                for process in stack.processes:
                    process.stop()


def test_a_replica_killed_mid_batch_loses_no_line_and_charges_none_twice(two_replicas: Stack) -> None:
    stack = two_replicas
    survivor, doomed = stack.coordinator, stack.consumer_side
    provider = stack.account()
    node = stack.node("fleet", provider, upstream=stack.upstream, models=(MODEL,),  # type: ignore[attr-defined]
                      max_concurrency=6, first_token_delay=0.3)
    stack.wait_listed(provider, node.session_id)
    consumer = stack.account(credit=100_000_000)
    credit = stack.balance(consumer)
    client = sdk(doomed.api_url, consumer.api_key)
    batch = run_batch(client, [chat_line(f"k-{i}") for i in range(LINES)])
    wait_counts(client, batch.id, 4)
    os.kill(doomed.process.proc.pid, 9)  # SIGKILL: its leases, reservations and runner die with it
    doomed.process.proc.wait(10)
    stack.consumer = survivor
    client = sdk(survivor.api_url, consumer.api_key)
    done = wait_status(client, batch.id, timeout=180)
    assert done.status == "completed" and done.request_counts.completed == LINES
    output = file_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"k-{i}" for i in range(LINES))  # each once
    taken_over = stack._query("SELECT count(*) FROM batch_lines WHERE attempts > 1")[0][0]
    assert taken_over > 0  # lines the dead replica held ran again on the survivor
    wait_until(lambda: not stack._query("SELECT 1 FROM reservations WHERE status = 'open'"), timeout=60,
               interval=0.5, what="the dead replica's reservations reconciled")
    rows = [row for row in stack.usage(consumer) if row.get("batch_id") == batch.id]
    assert len({row["custom_id"] for row in rows}) == len(rows) <= LINES  # no line charged twice
    costs = {line["response"]["request_id"]: line["response"]["body"]["usage"]["cost_micro_usd"] for line in output}
    assert all(costs[row["request_id"]] == row["cost_micro_usd"] for row in rows)
    assert sum(costs.values()) == sum(row["cost_micro_usd"] for row in rows) == credit - stack.balance(consumer)
