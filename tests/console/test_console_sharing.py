"""Shares in the console, in Chromium, against a real coordinator and two real nodes of one owner
(`darkbloom serve --backend openai` in front of bench/fixed_upstream.py, named studio and laptop):
the owner shares all machines, then a subset with limits and prices, from the Sharing page, and is
shown each share's invite code once; field errors stand next to their field; the grantee verifies their
address with a code mailed through a real SMTP server, sees the pending share with the owner's email,
its machines and prices and whose hardware it is, accepts it, chats with Shared machines and is
answered by the owner's node for free; another share is accepted with its invite code, another
declined; the
owner sees what the share used today and revokes it, after which the grantee's chat says nobody has
shared a machine with them; a used-up daily limit says when it resets; a grantee leaves a share; phone
and desktop layouts fit. The tests run in
file order and share the owner's and the grantee's tabs."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from tests.console.conftest import DESKTOP, PHONE, Tab, signed_in_tab
from tests.support.accounts import Account, create_account, device_token, start_node
from tests.support.mailbox import Mailbox, smtp_server
from tests.support.processes import Coordinator, Process, start_coordinator, start_fixed_upstream, wait_until

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
FIXED_ANSWER = "The quick brown fox jumps over the lazy dog."  # bench/fixed_upstream.py's answer
FIXED_USAGE = (12, 10)                                          # its prompt and completion tokens
NO_SHARED_MACHINE = ("Nobody has shared a machine with you and you have none of your own — ask someone to share "
                     "theirs with your email, or link a machine of your own under Link a machine.")
QUOTA = ("You've used today's allowance on the machines shared with you — it resets at 00:00 UTC (wait for the "
         "countdown), or choose Network.")
BAD_EMAIL = "Enter the email address of the person you're sharing with, like name@example.com."
OWN_EMAIL = "That's your own email — your machines already serve you: choose My Machine in Chat."
BAD_PRICE = "Enter a price in dollars from 0 to 1,000,000 (at most 6 decimals), or leave it empty for free."


def operator_sentence(owner: str) -> str:
    return (f"These machines belong to {owner}, who runs them. Your requests are encrypted to their node like any "
            f"provider's, and the node decrypts them to answer — on {owner}'s hardware, with software they "
            "control. Send only what you would trust them with.")


@dataclass
class World:
    coord: Coordinator
    owner: Account
    grantee: Account
    owner_tab: Tab
    grantee_tab: Tab
    machines: dict[str, str]  # name → mach_ id
    sessions: dict[str, str]  # name → the node's provider session id
    mailbox: Mailbox
    processes: list[Process] = field(default_factory=list)

    def api(self, method: str, path: str, account: Account, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.coord.api_url + path, timeout=30,
                             headers={"Authorization": f"Bearer {account.session}"}, **kwargs)

    def shares(self, account: Account) -> dict[str, list[dict[str, Any]]]:
        response = self.api("GET", "/shares", account)
        assert response.status_code == 200, response.text
        return dict(response.json())


def named_node(coord: Coordinator, owner: Account, home: Path, name: str, upstream: str) -> Process:
    """A machine of ``owner`` named ``name`` (provider.toml), linked as `darkbloom login` would."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "provider.toml").write_text(f'[node]\nname = "{name}"\n')
    (home / "auth_token").write_text(device_token(coord, owner) + "\n")
    os.chmod(home / "auth_token", 0o600)
    return start_node(coord, home, "--backend", "openai", "--upstream-url", upstream, "--model", MODEL)


@pytest.fixture(scope="module")
def world(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("console-sharing")
    mail = smtp_server()
    mailbox, smtp_port = mail.__enter__()
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}",
                              "--smtp-url", f"smtp://127.0.0.1:{smtp_port}")
    processes: list[Process] = []
    contexts: list[Any] = []
    try:
        upstream, upstream_url = start_fixed_upstream(root / "upstream")
        processes.append(upstream)
        owner, grantee = create_account(coord), create_account(coord)
        for name in ("studio", "laptop"):
            processes.append(named_node(coord, owner, root / name, name, upstream_url))

        def both_online() -> list[dict[str, Any]] | None:
            for process in processes:
                assert process.proc.poll() is None, process.log()
            listing = httpx.get(coord.api_url + "/me/providers", headers=owner.headers(owner.session)).json()["data"]
            online = [m for m in listing if m["online"] and m["name"] in ("studio", "laptop") and MODEL in m["models"]]
            return online if len(online) == 2 else None

        machines = wait_until(both_online, timeout=120, interval=0.3, what="both machines online")
        tabs = []
        for account in (owner, grantee):
            context, tab = signed_in_tab(browser, coord.base_url, account.session, account.email)
            contexts.append(context)
            tabs.append(tab)
        yield World(coord, owner, grantee, tabs[0], tabs[1], {m["name"]: m["id"] for m in machines},
                    {m["name"]: m["session_id"] for m in machines}, mailbox, processes)
        for tab in tabs:
            assert tab.errors == []
    finally:
        for context in contexts:
            context.close()
        for process in processes:
            process.stop()
        coord.stop()
        mail.__exit__(None, None, None)


def open_share_form(page: Any) -> None:
    page.get_by_role("button", name="Share machines").click()
    expect(page.locator("#share-form-title")).to_be_focused()


def share_posts(tab: Tab) -> list[dict[str, Any]]:
    return [json.loads(c[3] or "{}") for c in tab.calls("/v1/shares") if c[0] == "POST"]


def send(page: Any, text: str) -> Any:
    before = page.locator(".turn.assistant").count()
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")
    answer = page.locator(".turn.assistant").nth(before)
    expect(answer).to_have_attribute("aria-busy", "false", timeout=60_000)
    return answer


def test_owner_shares_all_machines_from_the_page(world: World) -> None:
    page = world.owner_tab.page
    page.goto("/console/sharing")
    expect(page.get_by_role("link", name="Sharing")).to_have_attribute("aria-current", "page")
    expect(page.locator("#given-list")).to_contain_text("You haven't shared your machines with anyone")
    expect(page.locator("#received-list")).to_contain_text("Nobody has shared a machine with you")
    open_share_form(page)
    page.get_by_label("Their email").fill(world.grantee.email.upper())
    expect(page.get_by_label("All my machines, and any I link later")).to_be_checked()
    expect(page.locator("#machine-choices")).to_be_hidden()
    expect(page.locator("#share-price-summary")).to_contain_text("Free: they pay nothing")
    page.get_by_role("button", name="Share", exact=True).click()

    expect(page.locator("#sharing-status")).to_contain_text(
        f"Shared with {world.grantee.email}. They can use your machines once they accept.")
    expect(page.locator("#share-form")).to_be_hidden()
    expect(page.locator("#invite-panel")).to_be_visible()  # the invite code, shown this once
    expect(page.locator("#invite-code")).to_have_text(re.compile(r"^dki-[A-Za-z0-9_-]{40,}$"))
    card = page.locator("#given-list .share")
    expect(card).to_have_count(1)
    expect(card.locator(".share-name")).to_have_text(world.grantee.email)
    expect(card.locator(".badge.free")).to_have_text("Free")
    expect(card.locator(".badge.status")).to_have_text("Waiting for them to accept")
    expect(card).to_contain_text("All your machines, and any you link later")
    expect(card.locator(".share-today")).to_have_text("0 requests · 0 tokens")
    expect(card).to_contain_text("When you revoke it")
    # all machines: the field left out; free: both prices 0
    assert share_posts(world.owner_tab) == [{"email": world.grantee.email.upper(), "input_price": 0, "output_price": 0}]
    given = world.shares(world.owner)["given"]
    assert [(s["grantee_email"], s["machines"], s["daily_request_limit"], s["input_price"], s["expires_at"],
             s["status"]) for s in given] == [(world.grantee.email, "all", None, 0, None, "pending")]
    page.reload()
    expect(page.locator("#invite-panel")).to_be_hidden()  # never shown again


def test_a_bad_email_or_your_own_shows_the_error_next_to_the_field(world: World) -> None:
    page, tab = world.owner_tab.page, world.owner_tab
    page.goto("/console/sharing")
    open_share_form(page)
    email = page.get_by_label("Their email")
    error = page.locator("#share-email-error")
    tab.api_calls.clear()

    email.fill("not-an-email")
    page.get_by_role("button", name="Share", exact=True).click()
    expect(error).to_have_text(BAD_EMAIL)                 # the API's 400, param "email"
    expect(email).to_have_attribute("aria-invalid", "true")
    expect(email).to_be_focused()
    # the line sits under its field and the field names it
    assert page.locator(".field", has=email).locator("#share-email-error").count() == 1
    assert "share-email-error" in (email.get_attribute("aria-describedby") or "")

    email.fill(world.owner.email)
    expect(error).to_be_empty()                           # typing clears it
    page.get_by_role("button", name="Share", exact=True).click()
    expect(error).to_have_text(OWN_EMAIL)
    assert [body["email"] for body in share_posts(tab)] == ["not-an-email", world.owner.email]

    # a price the page cannot turn into whole µUSD is refused before anything is sent
    email.fill("friend@example.com")
    page.get_by_label("Input (USD per 1M tokens)").fill("0.1234567")
    page.get_by_role("button", name="Share", exact=True).click()
    expect(page.locator("#share-input-price-error")).to_have_text(BAD_PRICE)
    expect(page.get_by_label("Input (USD per 1M tokens)")).to_be_focused()
    expect(error).to_be_empty()
    assert len(share_posts(tab)) == 2
    page.keyboard.press("Escape")
    expect(page.locator("#share-form")).to_be_hidden()
    expect(page.get_by_role("button", name="Share machines")).to_be_focused()
    assert len(world.shares(world.owner)["given"]) == 1


def test_owner_shares_a_subset_with_limits_prices_and_a_last_day(world: World) -> None:
    page, tab = world.owner_tab.page, world.owner_tab
    page.goto("/console/sharing")
    open_share_form(page)
    page.get_by_label("Their email").fill("household@example.com")  # no account yet: accepted all the same
    page.get_by_label("Only the machines I tick").check()
    expect(page.locator("#machine-choices")).to_be_visible()
    # nothing ticked: said next to the machines, nothing sent
    tab.api_calls.clear()
    page.get_by_role("button", name="Share", exact=True).click()
    expect(page.locator("#share-machines-error")).to_have_text("Tick at least one machine, or share all of them.")
    assert share_posts(tab) == []
    page.locator("#machine-choices").get_by_label("laptop").check()
    page.get_by_label("Requests per day").fill("5")
    page.get_by_label("Tokens per day").fill("10000")
    page.get_by_label("Input (USD per 1M tokens)").fill("0.4")
    page.get_by_label("Output (USD per 1M tokens)").fill("1.6")
    expect(page.locator("#share-price-summary")).to_have_text(
        "They pay $0.40 per 1M input tokens and $1.60 per 1M output tokens from their credit; you earn that, "
        "less the platform fee.")
    last_day = date.today() + timedelta(days=30)
    page.get_by_label("Last day (optional)").fill(last_day.isoformat())
    page.locator("#share-form-title").focus()
    world.owner_tab.shoot("sharing-form")
    page.get_by_role("button", name="Share", exact=True).click()
    expect(page.locator("#sharing-status")).to_contain_text("Shared with household@example.com.")

    # the end of the last day, the browser's time (the same zone as this process's)
    ends = (datetime(last_day.year, last_day.month, last_day.day) + timedelta(days=1)).astimezone()
    [body] = share_posts(tab)
    assert body == {"email": "household@example.com", "machines": [world.machines["laptop"]],
                    "daily_request_limit": 5, "daily_token_limit": 10000, "input_price": 400_000,
                    "output_price": 1_600_000, "expires_at": body["expires_at"]}
    assert body["expires_at"].endswith("Z") and datetime.fromisoformat(body["expires_at"]) == ends
    shared = {s["grantee_email"]: s for s in world.shares(world.owner)["given"]}["household@example.com"]
    assert shared["machines"] == [world.machines["laptop"]]
    assert (shared["input_price"], shared["output_price"]) == (400_000, 1_600_000)

    card = page.locator("#given-list .share", has_text="household@example.com")
    expect(card.locator(".badge.charged")).to_have_text("At your prices")
    expect(card).to_contain_text("laptop")
    expect(card).not_to_contain_text("studio")
    expect(card).to_contain_text("$0.40 in · $1.60 out per 1M tokens")
    expect(card).to_contain_text("5 requests · 10,000 tokens a day")
    last = page.evaluate(f"new Date({last_day.year}, {last_day.month - 1}, {last_day.day})"
                         ".toLocaleDateString(undefined, {year: 'numeric', month: 'short', day: 'numeric'})")
    expect(card).to_contain_text(f"At the end of {last}")
    expect(card.locator(".share-today")).to_have_text("0 requests of 5 · 0 tokens of 10,000")


def test_grantee_verifies_the_address_and_accepts_the_pending_share(world: World) -> None:
    page = world.grantee_tab.page
    page.goto("/console/sharing")
    # nothing sent to an address is shown before its owner proves it is theirs
    expect(page.locator("#received-list")).to_contain_text("Nobody has shared a machine with you")
    expect(page.locator("#verify-panel")).to_be_visible()
    expect(page.locator("#verify-email")).to_have_text(world.grantee.email)
    page.get_by_role("button", name="Email me a code").click()
    expect(page.locator("#consent-status")).to_have_text(f"We sent a code to {world.grantee.email}. Type it below.")
    expect(page.get_by_label("Code from the email")).to_be_focused()
    page.get_by_label("Code from the email").fill("WRNG-CODE")
    page.get_by_role("button", name="Verify", exact=True).click()
    expect(page.locator("#verify-code-error")).to_contain_text("isn't the code we sent last")
    page.get_by_label("Code from the email").fill(world.mailbox.code_for(world.grantee.email))
    page.get_by_role("button", name="Verify", exact=True).click()
    expect(page.locator("#consent-status")).to_have_text(
        "Your email address is verified: shares sent to it are listed below.")
    expect(page.locator("#verify-panel")).to_be_hidden()

    card = page.locator("#received-list .share")
    expect(card).to_have_count(1)
    expect(card.locator(".share-name")).to_have_text(f"From {world.owner.email}")
    expect(card.locator(".badge.status")).to_have_text("Waiting for your answer")
    expect(card.locator(".share-note.operator")).to_have_text(operator_sentence(world.owner.email))
    expect(card.locator(".share-note.consent")).to_contain_text(
        f"Accept to let your requests on Shared machines go to {world.owner.email}'s machines, for free.")
    expect(card).to_contain_text("All their machines: ")
    for name in ("studio", "laptop"):
        expect(card).to_contain_text(name)
    expect(card.locator(".badge.free")).to_have_text("Free")
    expect(page.locator("#given-list")).to_contain_text("You have no machines to share yet")
    world.grantee_tab.shoot("sharing-pending")
    # not accepted yet: Shared machines finds nothing to use
    refused = httpx.post(world.coord.api_url + "/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {world.grantee.session}", "X-Darkbloom-Route": "shared"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_shared_machine", refused.text
    world.grantee_tab.api_calls.clear()
    card.get_by_role("button", name=f"Accept the share from {world.owner.email}").click()
    expect(page.locator("#sharing-status")).to_have_text(
        f"You accepted {world.owner.email}'s share: choose Shared machines in Chat to use it.")
    expect(card.locator(".badge.status")).to_have_count(0)
    expect(card.get_by_role("button", name=f"Accept the share from {world.owner.email}")).to_have_count(0)
    [sent] = [c for c in world.grantee_tab.api_calls if c[0] == "POST" and c[1].endswith("/accept")]
    assert json.loads(sent[3]) == {"machines": "all", "input_price": 0, "output_price": 0}  # the terms shown
    assert world.shares(world.owner)["given"][0]["status"] == "accepted"
    world.grantee_tab.shoot("sharing-received")


def test_grantee_sees_who_runs_the_machines_and_chats_on_them(world: World) -> None:
    page, tab = world.grantee_tab.page, world.grantee_tab

    page.goto("/console/")
    shared = page.get_by_role("radio", name="Shared machines")
    shared.check()
    assert page.evaluate("localStorage.getItem('darkbloom.route')") == "shared"
    expect(page.locator("#machine-state")).to_contain_text(f"shared with you by {world.owner.email}, who runs them")
    # the picker offers what the owner's machines serve the grantee: /v1/models as the shared route sees it
    expect(page.locator("#model option")).to_have_text([MODEL])
    assert any(c[0] == "GET" and c[2].get("x-darkbloom-route") == "shared" for c in tab.calls("/v1/models"))
    page.get_by_label("Model").select_option(MODEL)
    tab.api_calls.clear()

    answer = send(page, "Hello from the household")

    expect(answer.locator(".badge")).to_have_text("shared machine · free")
    expect(answer.locator(".answer")).to_have_text(FIXED_ANSWER)
    sent = [c for c in tab.calls("/v1/chat/completions") if c[0] == "POST"]
    assert [c[2].get("x-darkbloom-route") for c in sent] == ["shared"]
    # served by one of the owner's nodes, through the share, for nothing
    row = world.api("GET", "/payments/usage", world.grantee).json()["data"][0]
    share_id = world.shares(world.grantee)["received"][0]["id"]
    assert (row["routed"], row["share_id"], row["cost_micro_usd"]) == ("shared", share_id, 0)
    assert row["provider_id"] in world.sessions.values()
    assert world.api("GET", "/payments/balance", world.grantee).json()["balance_micro_usd"] == 0
    world.grantee_tab.shoot("chat-shared")
    # remembered: a reload keeps Shared machines
    page.reload()
    expect(page.get_by_role("radio", name="Shared machines")).to_be_checked()
    # the usage page marks the row a share served for free
    page.goto("/console/usage")
    row = page.locator("#usage-rows tr").first
    expect(row.locator(".badge")).to_have_text("shared machine · free")
    expect(row.locator("td.num")).to_have_text("Free")
    expect(row).to_have_class("free-row")


def test_owner_sees_what_the_share_used_today_and_revokes_it(world: World) -> None:
    page = world.owner_tab.page
    page.goto("/console/sharing")
    card = page.locator("#given-list .share", has_text=world.grantee.email)
    prompt, completion = FIXED_USAGE
    expect(card.locator(".share-today")).to_have_text(
        f"1 request · {prompt + completion} tokens ({prompt} in, {completion} out)")
    world.owner_tab.shoot("sharing")

    card.get_by_role("button", name=f"Revoke the share with {world.grantee.email}").click()
    dialog = page.locator("#end-dialog")
    expect(dialog.locator("#end-title")).to_have_text(f"Revoke the share with {world.grantee.email}?")
    dialog.get_by_role("button", name="Cancel").click()
    expect(card).to_have_count(1)
    card.get_by_role("button", name=f"Revoke the share with {world.grantee.email}").click()
    dialog.get_by_role("button", name="Revoke").click()
    expect(page.locator("#sharing-status")).to_have_text(f"Revoked the share with {world.grantee.email}.")
    expect(card).to_have_count(0)
    assert [s["grantee_email"] for s in world.shares(world.owner)["given"]] == ["household@example.com"]

    # nothing owned and nothing shared any more: the chat says so
    grantee = world.grantee_tab.page
    grantee.goto("/console/")
    expect(grantee.get_by_role("radio", name="Shared machines")).to_be_checked()
    expect(grantee.locator("#machine-state")).to_contain_text("Nobody has shared a machine with you yet")
    grantee.get_by_label("Model").select_option(MODEL)
    answer = send(grantee, "Still there?")
    expect(answer.locator(".error-sentence")).to_have_text(NO_SHARED_MACHINE)


def test_a_used_up_daily_limit_says_when_it_resets_and_the_grantee_leaves(world: World) -> None:
    response = world.api("POST", "/shares", world.owner, json={"email": world.grantee.email, "daily_request_limit": 1})
    assert response.status_code == 201, response.text
    page = world.grantee_tab.page
    page.goto("/console/sharing")
    page.get_by_label("Invite code").fill("dki-mistyped")
    page.get_by_role("button", name="Accept invite").click()
    expect(page.locator("#invite-input-error")).to_contain_text("That code doesn't open any share")
    page.get_by_label("Invite code").fill(response.json()["invite_code"])
    page.get_by_role("button", name="Accept invite").click()
    expect(page.locator("#consent-status")).to_have_text(
        f"You accepted {world.owner.email}'s share: choose Shared machines in Chat to use it.")
    expect(page.locator("#received-list .share")).to_have_count(1)
    expect(page.get_by_label("Invite code")).to_have_value("")
    page.goto("/console/")
    expect(page.get_by_role("radio", name="Shared machines")).to_be_checked()
    expect(page.locator("#machine-state")).to_contain_text(world.owner.email)
    page.get_by_label("Model").select_option(MODEL)
    expect(send(page, "One").locator(".badge")).to_have_text("shared machine · free")
    answer = send(page, "Two")
    expect(answer.locator(".error-sentence")).to_have_text(QUOTA)
    # Retry-After runs to 00:00 UTC: hours and minutes, not thousands of seconds
    expect(answer.locator(".countdown")).to_have_text(
        re.compile(r"^Retry in (\d+ h( \d+ min)?|\d+ min( \d+ s)?|\d+ s)$"))
    expect(answer.get_by_role("button", name="Retry")).to_be_disabled()

    page.goto("/console/sharing")
    card = page.locator("#received-list .share")
    expect(card).to_have_count(1)
    expect(card).to_contain_text("1 request a day")
    prompt, completion = FIXED_USAGE
    expect(card.locator(".share-today")).to_have_text(
        f"1 request of 1 · {prompt + completion} tokens ({prompt} in, {completion} out)")
    card.get_by_role("button", name=f"Leave the share from {world.owner.email}").click()
    page.locator("#end-dialog").get_by_role("button", name="Leave").click()
    expect(page.locator("#sharing-status")).to_have_text(f"You left {world.owner.email}'s share.")
    expect(page.locator("#received-list")).to_contain_text("Nobody has shared a machine with you")
    assert world.shares(world.grantee)["received"] == []
    assert response.json()["id"] not in [s["id"] for s in world.shares(world.owner)["given"]]


def _fits(page: Any, width: int) -> None:
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"{page.url} is {scroll} px wide in a {width} px window"


def test_sharing_and_the_machine_choice_fit_a_phone_and_a_desktop(world: World) -> None:
    world.api("POST", "/shares", world.owner, json={"email": world.grantee.email, "input_price": 250_000,
                                                     "output_price": 1_000_000}).raise_for_status()
    for tab, form in ((world.owner_tab, True), (world.grantee_tab, False)):
        page = tab.page
        for size in (PHONE, DESKTOP):
            page.set_viewport_size(size)
            page.goto("/console/sharing")
            expect(page.locator(".share").first).to_be_visible()
            if form:
                open_share_form(page)
                page.get_by_label("Only the machines I tick").check()
            _fits(page, size["width"])
            page.goto("/console/")
            expect(page.get_by_role("radio", name="Shared machines")).to_be_visible()
            _fits(page, size["width"])
        page.set_viewport_size(DESKTOP)
    # a priced share says so to its grantee
    page = world.grantee_tab.page
    page.goto("/console/sharing")
    card = page.locator("#received-list .share")
    expect(card).to_contain_text("$0.25 in · $1.00 out per 1M tokens, paid from your credit")
    expect(card.locator(".badge.charged")).to_have_text("At their prices")
    expect(card.locator(".share-note.consent")).to_contain_text("at the prices above, paid from your credit")
    assert re.search(r"\S", card.locator(".share-note.operator").inner_text())
    # declined: it routes nothing, and the owner sees the answer
    card.get_by_role("button", name=f"Decline the share from {world.owner.email}").click()
    expect(page.locator("#sharing-status")).to_have_text(
        f"You declined {world.owner.email}'s share. Nothing goes to their machines.")
    expect(card.locator(".badge.status")).to_have_text("You declined")
    expect(card.get_by_role("button", name=f"Accept the share from {world.owner.email}")).to_be_visible()
    assert [s["status"] for s in world.shares(world.owner)["given"] if s["input_price"] == 250_000] == ["declined"]


def test_revoking_a_share_already_gone_says_so_and_refreshes_the_list(world: World) -> None:
    given = world.api("POST", "/shares", world.owner, json={"email": "gone@example.com"}).json()
    page = world.owner_tab.page
    page.goto("/console/sharing")
    card = page.locator("#given-list .share", has_text="gone@example.com")
    expect(card).to_have_count(1)
    assert world.api("DELETE", f"/shares/{given['id']}", world.owner).status_code == 204  # elsewhere, meanwhile
    card.get_by_role("button", name="Revoke the share with gone@example.com").click()
    page.locator("#end-dialog").get_by_role("button", name="Revoke").click()
    expect(page.locator("#sharing-status [data-code=share_not_found]")).to_have_text(
        "That share no longer exists — its owner revoked it, or the person it was shared with left it.")
    expect(card).to_have_count(0)
