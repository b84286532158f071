"""The Files and Batch APIs end to end, through the official `openai` SDK against a real coordinator
(SQLite and Postgres) and real nodes: paid fleet batches at the batch discount, free self-route
batches, every bad input, cancel in flight, a balance that runs out, a machine that goes offline."""

from __future__ import annotations

import io
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.batches.support import (MODEL, chat_line, file_lines, jsonl, priced_stack, run_batch, sdk, wait_counts,
                                   wait_status)
from tests.selfroute.support import Node, Stack
from tests.support.accounts import Account
from tests.support.databases import database_for
from tests.support.processes import start_fixed_upstream

pytestmark = pytest.mark.e2e


class World:
    def __init__(self, stack: Stack, upstream: str) -> None:
        self.stack, self.upstream = stack, upstream
        self.provider = stack.account()
        self.fleet_node = stack.node("fleet", self.provider, upstream=upstream, models=(MODEL,), max_concurrency=4)
        stack.wait_listed(self.provider, self.fleet_node.session_id)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp(f"batches-{request.param}")
    with database_for(request.param, root) as url:
        stack = priced_stack(root, url)
        upstream_process, upstream = start_fixed_upstream(root / "upstream")
        stack.processes.append(upstream_process)
        try:
            yield World(stack, upstream)
        finally:
            stack.close()


def live_cost(world: World, token: str, content: str = "Say something.") -> int:
    answer = world.stack.chat(token, model=MODEL, messages=[{"role": "user", "content": content}])
    assert answer.status_code == 200, answer.text
    return int(answer.headers["X-Darkbloom-Cost-Micro-USD"])


def test_a_fleet_batch_through_the_sdk_costs_half_and_conserves_money(world: World) -> None:
    stack = world.stack
    consumer = stack.account(credit=50_000_000)
    client = sdk(stack.url, consumer.api_key)
    live = live_cost(world, consumer.api_key)
    before = stack.balance(consumer)
    before_earned = stack.earnings(world.provider)["total_micro_usd"]
    batch = run_batch(client, [chat_line(f"line-{i}") for i in range(6)])
    assert batch.status == "validating" and batch.request_counts.total == 6
    assert batch.model_extra["darkbloom_route"] == "fleet"
    done = wait_status(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6 and done.error_file_id is None
    output = file_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == [f"line-{i}" for i in range(6)]
    usage = [row for row in stack.usage(consumer) if row.get("batch_id") == batch.id]
    assert sorted(row["custom_id"] for row in usage) == [f"line-{i}" for i in range(6)]
    by_request = {row["request_id"]: row for row in usage}
    for line in output:
        response = line["response"]
        assert line["id"].startswith("batch_req_") and line["error"] is None and response["status_code"] == 200
        body = response["body"]
        assert body["choices"][0]["message"]["content"] and body["object"] == "chat.completion"
        assert body["usage"]["cost_micro_usd"] == by_request[response["request_id"]]["cost_micro_usd"]
        assert body["usage"]["cost_micro_usd"] == live // 2  # the batch discount (0.5), above the minimum charge
    charged = sum(row["cost_micro_usd"] for row in usage)
    assert charged == before - stack.balance(consumer) == done.model_extra["cost_micro_usd"]
    fee = sum(row["cost_micro_usd"] * 500 // 10_000 for row in usage)
    assert stack.earnings(world.provider)["total_micro_usd"] - before_earned == charged - fee  # payout follows


def test_files_api_lists_reads_and_deletes_only_the_callers_own(world: World) -> None:
    stack = world.stack
    owner, other = stack.account(), stack.account()
    client, stranger = sdk(stack.url, owner.api_key), sdk(stack.url, other.api_key)
    content = jsonl([chat_line("a")])
    uploaded = client.files.create(file=("mine.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes, uploaded.filename) == ("file", "batch", len(content),
                                                                                      "mine.jsonl")
    assert uploaded.id in [f.id for f in client.files.list().data]
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == content
    for call in (lambda: stranger.files.retrieve(uploaded.id), lambda: stranger.files.content(uploaded.id),
                 lambda: stranger.files.delete(uploaded.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "file_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        stranger.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert uploaded.id not in [f.id for f in stranger.files.list().data]
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


@pytest.mark.parametrize("content, line", [
    (b"this is not json\n", 1),
    (jsonl([chat_line("a"), {**chat_line("b"), "url": "/v1/images/generations"}]), 2),
    (jsonl([chat_line("a"), chat_line("b"), chat_line("a")]), 3),
    (jsonl([chat_line("a", content="x" * (9 * 1024 * 1024))]), 1),
])
def test_a_bad_input_file_is_refused_naming_its_line(world: World, content: bytes, line: int) -> None:
    account = world.stack.account()
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(world.stack.url, account.api_key).files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    assert f"Line {line} " in refused.value.message
    assert not sdk(world.stack.url, account.api_key).files.list().data  # nothing stored


def test_batch_creation_refuses_what_it_cannot_run(world: World) -> None:
    stack = world.stack
    account = stack.account()
    client = sdk(stack.url, account.api_key)
    other = client.files.create(file=("notes.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="assistants")
    with pytest.raises(openai.BadRequestError, match="purpose 'assistants'"):
        client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    good = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h")
    response = httpx.post(stack.url + "/batches", headers=account.headers(), json={
        "input_file_id": good.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "completion_window"
    with pytest.raises(openai.ConflictError) as unlinked:
        sdk(stack.url, account.api_key, route="self").batches.create(
            input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert unlinked.value.body["code"] == "no_linked_machine"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    assert client.batches.list().data == []


def test_a_self_route_batch_runs_free_on_the_callers_own_machine(world: World) -> None:
    stack = world.stack
    owner = stack.account()
    node = stack.node("own", owner, upstream=world.upstream, models=(MODEL,), max_concurrency=4)
    stack.wait_listed(owner, node.session_id)
    client = sdk(stack.url, owner.api_key, route="self")
    batch = run_batch(client, [chat_line(f"mine-{i}") for i in range(5)])
    assert batch.model_extra["darkbloom_route"] == "self"
    done = wait_status(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 5
    rows = [row for row in stack.usage(owner) if row.get("batch_id") == batch.id]
    assert len(rows) == 5 and all(r["routed"] == "owned" and r["cost_micro_usd"] == 0 for r in rows)
    assert all(line["response"]["body"]["usage"]["cost_micro_usd"] == 0
               for line in file_lines(client, done.output_file_id))
    assert stack.balance(owner) == 0
    node.stop()


def test_cancel_lets_lines_in_flight_finish_and_charges_nothing_more(world: World) -> None:
    stack = world.stack
    owner = stack.account(credit=50_000_000)
    slow = stack.node("slow", owner, upstream=world.upstream, models=(MODEL,), max_concurrency=2,
                      first_token_delay=1.0)
    stack.wait_listed(owner, slow.session_id)
    client = sdk(stack.url, owner.api_key, route="self")
    batch = run_batch(client, [chat_line(f"c-{i}") for i in range(8)])
    wait_counts(client, batch.id, 1)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at is not None
    done = wait_status(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    answered = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert 1 <= len(answered) < 8 and len(answered) + len(errors) == 8
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and all(e["response"] is None for e in errors)
    rows = [row for row in stack.usage(owner) if row.get("batch_id") == batch.id]
    assert sorted(r["custom_id"] for r in rows) == sorted(line["custom_id"] for line in answered)
    ended = run_batch_done(sdk(stack.url, owner.api_key))
    assert ended.status == "completed" and ended.request_counts.failed == 1
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(ended.id)
    slow.stop()


def run_batch_done(client: openai.OpenAI) -> Any:
    """A batch that ended (its one line on a model nobody serves fails at once)."""
    batch = run_batch(client, [{**chat_line("x"), "body": {**chat_line("x")["body"], "model": "no-such-model"}}])
    return wait_status(client, batch.id)


def test_a_paid_batch_whose_balance_runs_out_fails_the_rest_alone(world: World) -> None:
    stack = world.stack
    reserve = 64 * PRICE_OUT // 2  # a line's worst case at the batch price is about its output bound's
    consumer = stack.account(credit=3 * reserve)
    client = sdk(stack.url, consumer.api_key)
    batch = run_batch(client, [chat_line(f"b-{i}", max_tokens=64) for i in range(10)])
    done = wait_status(client, batch.id)
    assert done.status == "completed"
    answered, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert answered and errors and len(answered) + len(errors) == 10
    assert {e["error"]["code"] for e in errors} == {"insufficient_balance"}
    assert all(e["response"]["status_code"] == 402 and e["response"]["body"]["error"]["type"] == "insufficient_funds"
               for e in errors)  # the live error object
    rows = [row for row in stack.usage(consumer) if row.get("batch_id") == batch.id]
    balance = stack.balance(consumer)
    assert balance >= 0 and sum(r["cost_micro_usd"] for r in rows) == 3 * reserve - balance
    assert len(rows) == len(answered)


PRICE_OUT = 40  # µUSD per output token (40,000,000 per 1M)


def running_on_a_slow_machine(world: World, name: str, prefix: str) -> tuple[Account, Node, openai.OpenAI, Any]:
    """A self-route batch of six lines on the caller's one slow machine, its first line answered."""
    owner = world.stack.account()
    node = world.stack.node(name, owner, upstream=world.upstream, models=(MODEL,), max_concurrency=2,
                            first_token_delay=0.5)
    world.stack.wait_listed(owner, node.session_id)
    client = sdk(world.stack.url, owner.api_key, route="self")
    batch = run_batch(client, [chat_line(f"{prefix}-{i}") for i in range(6)])
    wait_counts(client, batch.id, 1)
    return owner, node, client, batch


def back_on(world: World, client: openai.OpenAI, batch: Any, owner: Account, name: str) -> Any:
    """The batch waiting (nothing failed), then finished once a machine of the owner's is online again."""
    waiting = client.batches.retrieve(batch.id)
    assert waiting.status == "in_progress" and waiting.request_counts.failed == 0
    node = world.stack.node(name, owner, upstream=world.upstream, models=(MODEL,), max_concurrency=2)
    world.stack.wait_listed(owner, node.session_id)
    done = wait_status(client, batch.id)
    node.stop()
    assert done.status == "completed" and done.request_counts.completed == 6 and done.error_file_id is None
    return done


def test_lines_wait_while_the_machine_is_offline_and_run_when_it_returns(world: World) -> None:
    owner, node, client, batch = running_on_a_slow_machine(world, "away", "w")
    node.stop()
    done = back_on(world, client, batch, owner, "away")
    assert sorted(line["custom_id"] for line in file_lines(client, done.output_file_id)) == [f"w-{i}" for i in range(6)]


def test_another_accounts_batch_is_not_found(world: World) -> None:
    stack = world.stack
    owner, other = stack.account(credit=5_000_000), stack.account()
    batch = run_batch(sdk(stack.url, owner.api_key), [chat_line("a")])
    stranger = sdk(stack.url, other.api_key)
    for call in (lambda: stranger.batches.retrieve(batch.id), lambda: stranger.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "batch_not_found"  # type: ignore[index]
    assert batch.id not in [b.id for b in stranger.batches.list().data]
    wait_status(sdk(stack.url, owner.api_key), batch.id)


def test_lines_wait_while_the_machine_is_unlinked_and_run_on_a_machine_linked_later(world: World) -> None:
    owner, node, client, batch = running_on_a_slow_machine(world, "unlinked", "u")
    machine = world.stack.machine_of(owner, node.session_id)
    unlinked = httpx.delete(f"{world.stack.url}/me/providers/{machine}", headers=owner.headers(owner.session))
    assert unlinked.status_code == 200, unlinked.text
    back_on(world, client, batch, owner, "replacement")
    rows = [row for row in world.stack.usage(owner) if row.get("batch_id") == batch.id]
    assert len(rows) == 6 and all(row["cost_micro_usd"] == 0 for row in rows)  # self-route: free throughout
    node.stop()
