"""The Batches page (docs/batches.md, docs/console.md "Batches") in Chromium, against a real coordinator
with a priced catalog and real nodes (`darkbloom serve --backend openai` in front of
bench/fixed_upstream.py): the signed-in account has two private machines — one fast, one slow (1 s
before each answer's first token, two slots, so its batch lines run one at a time) — and another
account's machine serves the network. Batches are made with the `openai` SDK as a user makes them: a
self-route batch pinned to the fast machine (completed, free, with a result file), a fleet batch with
metadata (completed, paid at the batch price), and a self-route batch pinned to the slow machine (in
progress). The page shows each one's status, counts, route and cost, refreshes while one is open,
cancels the slow one through its Cancel button (then shows it cancelled with its error file), and
downloads a result file with the session's Authorization header; a batch that ended while the page
still offered Cancel gets the API's 409 sentence; a new account sees the empty state. The tests run in
file order and share the signed-in tab."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright.sync_api import expect

from tests.batches.support import MODEL, chat_line, file_lines, jsonl, priced_stack, sdk, wait_counts, wait_status
from tests.console.conftest import DESKTOP, PHONE, Tab, signed_in_tab
from tests.selfroute.support import Stack
from tests.support.accounts import Account
from tests.support.processes import start_fixed_upstream, wait_until

pytestmark = pytest.mark.e2e

SELF_LINES = 5
FLEET_LINES = 4
SLOW_LINES = 40  # about a second each, one at a time: far longer than the page needs before it cancels
MACHINE = "X-Darkbloom-Machine"
LISTING = re.compile(r"/v1/batches\?limit=100$")


def usd(micro: int) -> str:
    """format.js's usd(): whole dollars with thousands separators, then every non-zero µUSD digit."""
    cents = str(micro % 1_000_000).rjust(6, "0").rstrip("0").ljust(2, "0")
    return f"${micro // 1_000_000:,}.{cents}"


@dataclass
class World:
    stack: Stack
    owner: Account
    tab: Tab
    self_batch: Any
    fleet_batch: Any
    slow_batch: Any

    def client(self, route: str | None = None) -> openai.OpenAI:
        return sdk(self.stack.url, self.owner.api_key, route)


def create_batch(client: openai.OpenAI, lines: list[dict[str, Any]], headers: dict[str, str] | None = None,
                 metadata: dict[str, str] | None = None) -> Any:
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata=metadata, extra_headers=headers)


@pytest.fixture(scope="module")
def world(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("console-batches")
    stack = priced_stack(root, f"sqlite+aiosqlite:///{root / 'coordinator.db'}")
    context = None
    try:
        upstream_process, upstream = start_fixed_upstream(root / "upstream")
        stack.processes.append(upstream_process)
        provider = stack.account()
        fleet = stack.node("fleet", provider, upstream=upstream, models=(MODEL,), max_concurrency=4)
        owner = stack.account(credit=50_000_000)
        private = ("--private-only",)  # the owner's machines never take the fleet batch's lines
        fast = stack.node("fast", owner, upstream=upstream, models=(MODEL,), max_concurrency=4, extra=private)
        slow = stack.node("slow", owner, upstream=upstream, models=(MODEL,), max_concurrency=2,
                          first_token_delay=1.0, extra=private)
        for account, node in ((provider, fleet), (owner, fast), (owner, slow)):
            stack.wait_listed(account, node.session_id)

        mine = sdk(stack.url, owner.api_key, route="self")
        self_batch = create_batch(mine, [chat_line(f"mine-{i}") for i in range(SELF_LINES)],
                                  {MACHINE: stack.machine_of(owner, fast.session_id)})
        fleet_batch = create_batch(sdk(stack.url, owner.api_key), [chat_line(f"fleet-{i}") for i in range(FLEET_LINES)],
                                   metadata={"job": "tickets", "team": "support"})
        for batch in (self_batch, fleet_batch):
            assert wait_status(mine, batch.id).status == "completed"
        # the next second: newest first puts it at the top (batches made in the same second are in id order)
        wait_until(lambda: time.time() >= fleet_batch.created_at + 1, timeout=5, interval=0.05, what="a new second")
        slow_batch = create_batch(mine, [chat_line(f"slow-{i}") for i in range(SLOW_LINES)],
                                  {MACHINE: stack.machine_of(owner, slow.session_id)})
        wait_counts(mine, slow_batch.id, 1)  # in progress, with a line answered
        context, tab = signed_in_tab(browser, stack.coordinator.base_url, owner.session, owner.email)
        yield World(stack, owner, tab, mine.batches.retrieve(self_batch.id),
                    sdk(stack.url, owner.api_key).batches.retrieve(fleet_batch.id), slow_batch)
        assert tab.errors == []
    finally:
        if context is not None:
            context.close()
        stack.close()


def card(page: Any, batch_id: str) -> Any:
    return page.locator(f".batch[data-id='{batch_id}']")


def fits_a_phone(page: Any) -> None:
    """No control without a name, and nothing wider than a 390 px screen (then back to desktop)."""
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(100)
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(el => el.tagName === 'BUTTON' ? !(el.textContent.trim() || el.getAttribute('aria-label'))
            : !(el.labels.length || el.getAttribute('aria-label')))
        .map(el => el.outerHTML.slice(0, 120))""")
    assert unlabelled == []
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the Batches page is {width} px wide at phone width"
    page.set_viewport_size(DESKTOP)


def listings(tab: Tab) -> int:
    return len([c for c in tab.calls("/v1/batches") if c[0] == "GET"])


def test_the_page_shows_each_batch_with_its_progress_route_and_cost(world: World) -> None:
    page, tab = world.tab.page, world.tab
    page.goto("/console/batches")
    expect(page).to_have_title("Batches · Darkbloom")
    expect(page.get_by_role("link", name="Batches")).to_have_attribute("aria-current", "page")
    cards = page.locator("#batch-list .batch")
    expect(cards).to_have_count(3)
    # the API's order: newest first (the two made in the same second in id order)
    listed = [batch.id for batch in world.client().batches.list(limit=100).data]
    assert listed[0] == world.slow_batch.id
    assert sorted(listed[1:]) == sorted([world.fleet_batch.id, world.self_batch.id])
    assert [cards.nth(i).get_attribute("data-id") for i in range(3)] == listed

    mine = card(page, world.self_batch.id)
    expect(mine.locator(".batch-name")).to_have_text(world.self_batch.id)
    expect(mine.locator(".batch-status")).to_have_text("Completed")
    expect(mine.locator(".batch-counts")).to_have_text(f"{SELF_LINES} done · 0 failed · {SELF_LINES} total")
    expect(mine.locator(".batch-route")).to_have_text("My machines (free)")
    expect(mine.locator("dt:text-is('Cost') + dd")).to_have_text("$0.00")
    expect(mine.locator(".batch-meta")).to_have_count(0)
    expect(mine.get_by_role("button", name=f"Download the results of batch {world.self_batch.id}")).to_have_text(
        "Download results")
    expect(mine.get_by_role("button", name=re.compile("errors|Cancel"))).to_have_count(0)
    bar = mine.get_by_role("progressbar")
    expect(bar).to_have_attribute("aria-valuenow", str(SELF_LINES))
    expect(bar).to_have_attribute("aria-valuemax", str(SELF_LINES))
    assert mine.locator(".batch-bar .s-done").evaluate("el => el.style.width") == "100%"

    fleet = card(page, world.fleet_batch.id)
    cost = world.fleet_batch.model_extra["cost_micro_usd"]
    assert cost > 0 and world.fleet_batch.model_extra["darkbloom_route"] == "fleet"
    expect(fleet.locator(".batch-status")).to_have_text("Completed")
    expect(fleet.locator(".batch-counts")).to_have_text(f"{FLEET_LINES} done · 0 failed · {FLEET_LINES} total")
    expect(fleet.locator(".batch-route")).to_have_text("The network (batch price)")
    expect(fleet.locator(".batch-cost")).to_have_text(usd(cost))
    expect(fleet.locator(".batch-meta li")).to_have_text(["job: tickets", "team: support"])
    expect(fleet.get_by_role("button", name=f"Download the results of batch {world.fleet_batch.id}")).to_have_text(
        "Download results")

    slow = card(page, world.slow_batch.id)
    expect(slow.locator(".batch-status")).to_have_text("In progress")
    expect(slow.locator(".batch-counts")).to_have_text(re.compile(rf"^\d+ done · 0 failed · {SLOW_LINES} total$"))
    expect(slow.locator(".batch-route")).to_have_text("My machines (free)")
    expect(slow.locator("dt:text-is('Cost so far') + dd")).to_have_text("$0.00")
    expect(slow.get_by_role("button", name=f"Cancel batch {world.slow_batch.id}")).to_be_visible()
    expect(slow.get_by_role("button", name=re.compile("Download"))).to_have_count(0)

    # an open batch: the list is asked for again (every 2 s), and its counts move on screen
    seen = listings(tab)
    for _ in range(150):
        if listings(tab) >= seen + 2:
            break
        page.wait_for_timeout(200)  # lets Playwright deliver the page's requests
    assert listings(tab) >= seen + 2, "the list was not asked for again while a batch was open"
    expect(slow.locator(".batch-counts")).to_have_text(re.compile(rf"^([2-9]|\d\d+) done · 0 failed"))
    expect(page.locator("#batches-updated")).to_contain_text("refreshes every 2 s while a batch runs")
    fits_a_phone(page)
    tab.shoot("batches")


def test_cancel_from_the_page_ends_the_batch_with_its_error_file(world: World) -> None:
    page, tab = world.tab.page, world.tab
    batch_id = world.slow_batch.id
    slow = card(page, batch_id)
    client = world.client("self")
    assert client.batches.retrieve(batch_id).status == "in_progress"
    cancel = slow.get_by_role("button", name=f"Cancel batch {batch_id}")
    cancel.click()
    dialog = page.locator("#cancel-dialog")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text(f"{batch_id}: lines already running on a machine finish")
    # Keep running: nothing sent, focus back on Cancel
    dialog.get_by_role("button", name="Keep running").click()
    expect(dialog).to_be_hidden()
    expect(slow.get_by_role("button", name=f"Cancel batch {batch_id}")).to_be_focused()
    assert not [c for c in tab.calls(f"/v1/batches/{batch_id}/cancel")]
    slow.get_by_role("button", name=f"Cancel batch {batch_id}").click()
    dialog.get_by_role("button", name="Cancel batch").click()

    expect(page.locator("#batches-status")).to_have_text(
        f"Cancelling {batch_id}: lines already running finish, the others won't run.")
    [call] = tab.calls(f"/v1/batches/{batch_id}/cancel")
    assert call[0] == "POST" and call[2]["authorization"] == f"Bearer {world.owner.session}"
    expect(slow.locator(".batch-status")).to_have_text("Cancelled", timeout=60_000)
    done = wait_status(client, batch_id)
    completed, failed = done.request_counts.completed, done.request_counts.failed
    assert done.status == "cancelled" and 1 <= completed < SLOW_LINES and completed + failed == SLOW_LINES
    expect(slow.locator(".batch-counts")).to_have_text(f"{completed} done · {failed} failed · {SLOW_LINES} total")
    expect(slow.locator(".batch-note")).to_have_text(
        "Cancelled: the lines that never ran are counted as failed, with the code batch_cancelled in its error file.")
    expect(slow.get_by_role("button", name=re.compile("^Cancel"))).to_have_count(0)
    expect(slow.get_by_role("button", name=f"Download the errors of batch {batch_id}")).to_be_visible()
    expect(slow.get_by_role("button", name=f"Download the results of batch {batch_id}")).to_be_visible()
    expect(slow.locator("dt:text-is('Cost') + dd")).to_have_text("$0.00")
    expect(slow.locator("dt:text-is('Cancelled') + dd")).not_to_be_empty()

    with page.expect_download() as info:
        slow.get_by_role("button", name=f"Download the errors of batch {batch_id}").click()
    errors = [json.loads(line) for line in Path(info.value.path()).read_text().splitlines()]
    assert len(errors) == failed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {e["custom_id"] for e in errors} == {f"slow-{i}" for i in range(SLOW_LINES)} - {
        line["custom_id"] for line in file_lines(client, done.output_file_id)}

    # every batch has ended: the page stops asking
    expect(page.locator("#batches-updated")).to_contain_text("every batch has ended")
    asked = listings(tab)
    page.wait_for_timeout(5_000)
    assert listings(tab) == asked
    fits_a_phone(page)
    page.mouse.move(0, 0)  # no button drawn hovered
    tab.shoot("batches-cancelled")


def test_download_results_saves_the_batchs_output_file(world: World) -> None:
    page, tab = world.tab.page, world.tab
    page.goto("/console/batches")
    batch = world.self_batch
    mine = card(page, batch.id)
    with page.expect_download() as info:
        mine.get_by_role("button", name=f"Download the results of batch {batch.id}").click()
    download = info.value
    assert download.suggested_filename == f"{batch.id}_output.jsonl"
    lines = [json.loads(line) for line in Path(download.path()).read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"mine-{i}" for i in range(SELF_LINES)]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    [call] = tab.calls(f"/v1/files/{batch.output_file_id}/content")
    assert call[2]["authorization"] == f"Bearer {world.owner.session}"  # the console's session, in a header
    expect(page.locator("#batches-status")).to_have_text(f"Saved {batch.id}_output.jsonl.")
    fits_a_phone(page)


def test_cancelling_a_batch_that_has_ended_shows_the_apis_sentence(world: World) -> None:
    """The page still offers Cancel for a batch that ended a moment ago (its list is rewritten to say
    in_progress, as if read just before it ended): the API's 409 is said, and the next list shows it
    as it is."""
    page = world.tab.page
    batch_id = world.fleet_batch.id
    stale = {"on": True}

    def listing(route: Any) -> None:
        response = route.fetch()
        body = response.json()
        if stale["on"]:
            for batch in body["data"]:
                if batch["id"] == batch_id:
                    batch["status"] = "in_progress"
        route.fulfill(response=response, body=json.dumps(body))

    page.route(LISTING, listing)
    try:
        page.goto("/console/batches")
        fleet = card(page, batch_id)
        fleet.get_by_role("button", name=f"Cancel batch {batch_id}").click()
        stale["on"] = False
        page.locator("#cancel-dialog").get_by_role("button", name="Cancel batch").click()
        error = page.locator("#batches-status .error-block")
        expect(error).to_have_attribute("data-code", "batch_not_cancellable")
        expect(error.locator(".error-sentence")).to_have_text(
            "This batch is completed: only a batch that is validating or in progress can be cancelled.")
        expect(fleet.locator(".batch-status")).to_have_text("Completed")
        expect(fleet.get_by_role("button", name=re.compile("^Cancel"))).to_have_count(0)
        expect(error).to_be_visible()  # the refresh keeps the sentence
        fits_a_phone(page)
    finally:
        page.unroute(LISTING)


def test_a_new_account_sees_what_batches_are_and_where_to_start(browser: Any, world: World) -> None:
    stranger = world.stack.account()
    context, tab = signed_in_tab(browser, world.stack.coordinator.base_url, stranger.session, stranger.email)
    try:
        page = tab.page
        page.goto("/console/batches")
        empty = page.locator("#batch-list .empty")
        expect(empty).to_contain_text("No batches yet.")
        expect(empty).to_contain_text("This page doesn't create them")
        expect(empty.locator("code")).to_have_text(["files.create", "batches.create", "docs/batches.md"])
        page.wait_for_timeout(3_000)
        assert listings(tab) == 1  # nothing open: asked once
        fits_a_phone(page)
    finally:
        context.close()
    assert tab.errors == []
