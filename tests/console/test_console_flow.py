"""The console as a person uses it, in Chromium, against a real coordinator and real nodes:
sign up, link two machines with the codes `darkbloom login` prints, hit the out-of-credit sentence
at zero balance, get credit and chat on My Machine for free (prefer reserves, then refunds in full),
make a "My Machine only — free" key, read usage, see the machine-offline sentence, log out and back
in. The tests run in file order and share one browser tab and account."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from tests.console.conftest import LoginCommand, Tab, open_tab
from tests.support.accounts import start_node
from tests.support.processes import (
    Coordinator,
    Process,
    _env,
    darkbloom_cmd,
    start_coordinator,
    wait_until,
)

pytestmark = pytest.mark.e2e

PASSWORD = "correct horse battery"
OUT_OF_CREDIT = ("You're out of credit — add credit to keep chatting. My Machine needs credit too: "
                 "the cost is held up front and refunded when your machine answers.")
OFFLINE = "Your machine is offline — start your Darkbloom node and retry."
NOT_FOUND = "That model isn't available — pick another one from the list."
UNAVAILABLE = ("No machine is serving this model right now — pick another model, "
               "or start your Darkbloom node and choose My Machine.")
CREDIT_MICRO_USD = 1_000_000


@dataclass
class Console:
    coord: Coordinator
    tab: Tab
    email: str
    root: Path
    nodes: list[Process] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)

    @property
    def page(self) -> Any:
        return self.tab.page

    def api(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        token = token or self.tab.session_token()
        return httpx.request(method, self.coord.base_url + path, headers={"Authorization": f"Bearer {token}"},
                             timeout=30, **kwargs)

    def balance(self) -> int:
        return int(self.api("GET", "/v1/payments/balance").json()["balance_micro_usd"])

    def credit(self, micro_usd: int) -> None:
        """An admin grants credit (POST /v1/admin/credit with the coordinator's admin token)."""
        httpx.post(self.coord.api_url + "/admin/credit", headers=self.coord.admin(), timeout=30, json={
            "email": self.email, "amount_micro_usd": micro_usd, "reference": "console-" + secrets.token_hex(6),
        }).raise_for_status()


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("console")
    coordinator = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}")
    try:
        yield coordinator
    finally:
        coordinator.stop()


@pytest.fixture(scope="module")
def console(browser: Any, coord: Coordinator, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """A person signs up in the browser (a zero-balance account)."""
    context, tab = open_tab(browser, coord.base_url)
    page = tab.page
    page.goto("/console/")
    expect(page).to_have_url(re.compile(r"/console/login\?next=%2Fconsole%2F$"))
    page.get_by_role("link", name="Create an account").click()
    expect(page).to_have_url(re.compile(r"/console/signup"))
    tab.shoot("signup")
    email = f"owner-{secrets.token_hex(4)}@example.com"
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign up").click()
    expect(page).to_have_url(re.compile(r"/console/$"))
    try:
        yield Console(coord, tab, email, tmp_path_factory.mktemp("nodes"))
    finally:
        context.close()


@pytest.fixture(scope="module")
def linked(console: Console, html_upstream: str) -> Iterator[Console]:
    """Two machines linked through /console/link with the codes `darkbloom login` printed: the
    first by following the printed link with ?code=, the second by typing the code; then started —
    one on the bundled model, one in front of the fake upstream whose answers contain HTML."""
    page, coord = console.page, console.coord
    homes = [console.root / "laptop", console.root / "html-box"]
    logins = []
    for home in homes:
        home.mkdir(parents=True, exist_ok=True)
        logins.append(LoginCommand(darkbloom_cmd("login", "--coordinator", coord.base_url, "--no-browser"),
                                   _env(home)))
    codes = [login.user_code() for login in logins]
    console.codes.extend(codes)

    page.goto(f"/console/link?code={codes[0]}")
    expect(page.get_by_label("Code from darkbloom login")).to_have_value(codes[0])
    page.get_by_role("button", name="Approve and link").click()
    expect(page.locator("#link-status")).to_contain_text("Machine linked.")
    console.tab.shoot("link")

    page.goto("/console/link")
    page.get_by_label("Code from darkbloom login").fill(codes[1].replace("-", "").lower())
    page.get_by_label("Code from darkbloom login").press("Enter")
    expect(page.locator("#link-status")).to_contain_text("Machine linked.")

    for login, home in zip(logins, homes):
        assert "Linked to account" in login.wait(timeout=30)
        assert (home / "auth_token").read_text().startswith("dkp-")
    console.nodes.append(start_node(coord, homes[0], "--max-concurrency", "1"))
    console.nodes.append(start_node(coord, homes[1], "--backend", "openai", "--upstream-url", html_upstream,
                                    "--model", "html-echo"))

    def both_serving() -> bool:
        for node in console.nodes:
            assert node.proc.poll() is None, node.log()
        models = console.api("GET", "/v1/me/self-route-models").json()["models"]
        return models == ["html-echo", "smollm2-135m"]

    wait_until(both_serving, timeout=120, interval=0.3, what="both machines serving")
    try:
        yield console
    finally:
        for node in console.nodes:
            node.stop()


def send(page: Any, text: str) -> Any:
    """Types a message, sends it with Enter, and returns the answer's list item once it is done."""
    before = page.locator(".turn.assistant").count()
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")
    answer = page.locator(".turn.assistant").nth(before)
    expect(answer).to_have_attribute("aria-busy", "false", timeout=60_000)
    return answer


def my_machine(page: Any, on: bool) -> None:
    """The chat's machine choice: My Machine (on) or Network (off)."""
    choice = page.get_by_role("radio", name="My Machine" if on else "Network")
    choice.check()
    expect(choice).to_be_checked()


def chat_requests(tab: Tab) -> list[tuple[str, str, dict[str, str], str | None]]:
    return [c for c in tab.calls("/v1/chat/completions") if c[0] == "POST"]


def test_signup_keeps_only_a_session_token_in_session_storage(console: Console) -> None:
    page = console.page
    assert console.tab.session_token().startswith("dks-")
    stored = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
    assert "dk-" not in stored and "dks-" not in stored, stored
    expect(page.locator("#account-email")).to_have_text(console.email)
    assert page.context.cookies() == []
    assert console.api("GET", "/v1/payments/balance").json() == {"balance_micro_usd": 0,
                                                                  "withdrawable_micro_usd": 0}


def test_machines_linked_through_the_console_are_listed_online(linked: Console) -> None:
    page = linked.page
    page.goto("/console/machines")
    cards = page.locator(".machine")
    expect(cards).to_have_count(2)
    expect(page.locator(".machine[data-online=true]")).to_have_count(2)
    expect(page.locator(".machine-list")).to_contain_text("smollm2-135m")
    expect(page.locator(".machine-list")).to_contain_text("html-echo")
    expect(cards.first).to_contain_text("Self-signed")
    expect(cards.first).to_contain_text("You first, and the network")
    expect(page.locator(".instructions")).to_contain_text(f"darkbloom login --coordinator {linked.coord.base_url}")
    linked.tab.shoot("machines")


def test_link_page_says_what_to_do_with_a_bad_or_used_code(linked: Console) -> None:
    page = linked.page
    page.goto("/console/link")
    code = page.get_by_label("Code from darkbloom login")
    code.fill("ZZZZ-ZZZZ")
    page.get_by_role("button", name="Approve and link").click()
    expect(page.locator("#link-status [data-code=invalid_code]")).to_contain_text("That code isn't valid")
    code.fill(linked.codes[0])
    page.get_by_role("button", name="Approve and link").click()
    expect(page.locator("#link-status [data-code=already_used]")).to_contain_text("That code was already used")
    expect(code).to_be_focused()


def test_chat_with_my_machine_off_at_zero_balance_says_out_of_credit(linked: Console) -> None:
    page, tab = linked.page, linked.tab
    assert linked.balance() == 0
    page.goto("/console/")
    my_machine(page, True)
    my_machine(page, False)
    page.get_by_label("Model").select_option("smollm2-135m")
    tab.api_calls.clear()

    answer = send(page, "Hello")

    expect(answer.locator(".error-sentence")).to_have_text(OUT_OF_CREDIT)
    assert [c[2].get("x-darkbloom-route") for c in chat_requests(tab)] == [None]
    assert page.evaluate("localStorage.getItem('darkbloom.route')") == "network"


def test_my_machine_at_zero_balance_is_out_of_credit_too(linked: Console) -> None:
    """prefer reserves the worst case up front (docs/self-route.md "Exclusive vs prefer"): with no credit it
    is refused with 402, even though the person's machine is online — and the console asks nothing else."""
    page, tab = linked.page, linked.tab
    my_machine(page, True)
    expect(page.locator("#machine-state")).to_contain_text("online")
    page.get_by_label("Model").select_option("smollm2-135m")
    tab.api_calls.clear()

    answer = send(page, "Hello on my machine")

    expect(answer.locator(".error-sentence")).to_have_text(OUT_OF_CREDIT)
    expect(answer.locator(".error-extra")).to_have_count(0)
    assert [c[2].get("x-darkbloom-route") for c in chat_requests(tab)] == ["prefer"]
    assert linked.balance() == 0
    tab.shoot("chat-no-credit")


def test_chat_with_my_machine_on_is_free_on_your_machine(linked: Console) -> None:
    page, tab = linked.page, linked.tab
    linked.credit(CREDIT_MICRO_USD)
    before = linked.balance()
    assert before == CREDIT_MICRO_USD
    page.goto("/console/")
    my_machine(page, True)
    assert page.evaluate("localStorage.getItem('darkbloom.route')") == "prefer"
    page.reload()
    expect(page.get_by_role("radio", name="My Machine")).to_be_checked()
    expect(page.locator("#machine-state")).to_contain_text("online")
    page.get_by_label("Model").select_option("smollm2-135m")
    page.locator(".options summary").click()
    page.get_by_label("Max answer tokens").fill("12")
    tab.api_calls.clear()

    answer = send(page, "Say hello in three words.")

    expect(answer.locator(".badge")).to_have_text("your machine · free")
    assert answer.locator(".answer").inner_text().strip() not in ("", "…")
    sent = chat_requests(tab)
    # My Machine sends prefer — a header, never a body field — and nothing else
    assert [c[2].get("x-darkbloom-route") for c in sent] == ["prefer"]
    for _, _, _, body in sent:
        assert set(json.loads(body or "{}")) == {"model", "messages", "stream", "max_tokens"}
    # prefer reserved up front and refunded all of it: your machine served
    assert linked.balance() == before
    newest = linked.api("GET", "/v1/payments/usage").json()["data"][0]
    assert newest["self_routed"] is True and newest["cost_micro_usd"] == 0 and newest["routed"] == "owned"


def test_model_answer_with_html_is_shown_as_text(linked: Console) -> None:
    page, tab = linked.page, linked.tab
    my_machine(page, True)
    expect(page.locator("#model option[value=html-echo]")).to_have_count(1)
    page.get_by_label("Model").select_option("html-echo")
    tab.api_calls.clear()

    answer = send(page, "Show me some HTML")

    expect(answer.locator(".badge")).to_have_text("your machine · free")
    assert [c[2].get("x-darkbloom-route") for c in chat_requests(tab)] == ["prefer"]
    text = answer.locator(".answer").inner_text()
    assert "<script>window.__pwned = 1; alert(1)</script>" in text
    assert '<img src=x onerror="window.__pwned = 2">' in text
    expect(answer.locator(".answer strong")).to_have_text("bold")
    expect(answer.locator(".answer code")).to_have_text("code")
    assert page.locator("#transcript script, #transcript img, #transcript iframe").count() == 0
    assert page.locator("#transcript a[href^='javascript']").count() == 0
    assert page.evaluate("window.__pwned") is None
    linked.tab.shoot("chat")


def _model_choices(page: Any) -> list[str]:
    expect(page.locator("#models-hint")).not_to_have_text("Loading models…")
    return page.locator("#model-choices input[type=checkbox]").evaluate_all("els => els.map(e => e.value)")


def test_key_with_my_machine_only_is_self_route_only(linked: Console) -> None:
    page = linked.page
    page.goto("/console/keys")
    expect(page.locator("#key-list")).to_contain_text("No keys yet")
    page.get_by_role("button", name="Create key").click()
    page.get_by_label("Name").fill("network key")
    only_mine = page.get_by_label("My Machine only — free")

    assert _model_choices(page) == ["smollm2-135m"]                    # the public models
    only_mine.check()
    assert _model_choices(page) == ["html-echo", "smollm2-135m"]       # /v1/me/self-route-models
    page.get_by_label("html-echo").check()
    only_mine.uncheck()
    assert _model_choices(page) == ["smollm2-135m"]
    page.get_by_label("smollm2-135m").check()
    page.get_by_label("Requests / min").fill("30")
    page.locator("#key-form").get_by_role("button", name="Create key").click()
    expect(page.locator("#secret-value")).to_have_text(re.compile(r"^dk-"))
    page.get_by_role("button", name="Done").click()

    page.get_by_role("button", name="Create key").click()
    page.get_by_label("Name").fill("laptop only")
    only_mine.check()
    page.get_by_label("html-echo").check()
    linked.tab.shoot("key-form")
    page.locator("#key-form").get_by_role("button", name="Create key").click()

    secret = page.locator("#secret-value")
    expect(secret).to_have_text(re.compile(r"^dk-"))
    key = secret.inner_text()
    page.get_by_role("button", name="Copy").click()
    expect(page.locator("#copy-status")).to_have_text("Copied to the clipboard.")
    assert page.evaluate("navigator.clipboard.readText()") == key
    expect(page.locator(".key")).to_have_count(2)
    linked.tab.shoot("keys")

    keys = {k["name"]: k for k in linked.api("GET", "/v1/keys").json()["data"]}
    assert keys["laptop only"]["self_route_only"] is True
    assert keys["laptop only"]["allowed_models"] == ["html-echo"]
    # the id ticked only in the hidden (My Machine) list was never submitted for the network key
    assert keys["network key"]["self_route_only"] is False
    assert keys["network key"]["allowed_models"] == ["smollm2-135m"]
    assert keys["network key"]["rpm_limit"] == 30
    # the key itself sees only its owner's machine
    listed = linked.api("GET", "/v1/models", token=key).json()["data"]
    assert [m["id"] for m in listed] == ["html-echo"]

    page.get_by_role("button", name="Done").click()
    expect(page.locator("#secret-panel")).to_be_hidden()
    assert key not in page.content()
    assert key not in page.evaluate("JSON.stringify(Object.assign({}, localStorage, sessionStorage))")


def test_keys_can_be_edited_and_deleted(linked: Console) -> None:
    page = linked.page
    page.goto("/console/keys")
    page.get_by_role("button", name="Edit key network key").click()
    expect(page.get_by_label("Name")).to_have_value("network key")
    expect(page.get_by_label("smollm2-135m")).to_be_checked()
    page.get_by_label("Name").fill("network key v2")
    page.get_by_label("Limit (USD)").fill("2.5")
    page.get_by_label("Resets").select_option("daily")
    page.get_by_role("button", name="Save changes").click()
    expect(page.locator("#keys-status")).to_have_text("Saved “network key v2”.")
    keys = {k["name"]: k for k in linked.api("GET", "/v1/keys").json()["data"]}
    edited = keys["network key v2"]
    assert (edited["limit_micro_usd"], edited["limit_reset"], edited["rpm_limit"]) == (2_500_000, "daily", 30)

    page.get_by_role("button", name="Delete key network key v2").click()
    page.locator("#delete-dialog").get_by_role("button", name="Delete key").click()
    expect(page.locator(".key")).to_have_count(1)
    assert linked.api("GET", f"/v1/keys/{edited['id']}").status_code == 404


def test_usage_page_shows_balance_and_marks_free_rows(linked: Console) -> None:
    page = linked.page
    page.goto("/console/usage")
    expect(page.locator("#balance")).to_have_text("$1.00")  # the credit, untouched by free answers
    expect(page.locator("#withdrawable")).to_have_text("$0.00")
    rows = page.locator("#usage-rows tr")
    expect(rows).to_have_count(2)
    expect(page.locator("#usage-rows tr.free-row")).to_have_count(2)
    expect(rows.first).to_contain_text("your machine · free")
    expect(rows.first).to_contain_text("html-echo")
    expect(page.locator("#earnings-rows")).to_contain_text("No earnings yet")
    linked.tab.shoot("usage")


def test_stopped_machine_shows_the_offline_sentence(linked: Console) -> None:
    page, tab = linked.page, linked.tab
    for node in linked.nodes:
        node.stop()
    wait_until(lambda: not any(m["online"] for m in linked.api("GET", "/v1/me/providers").json()["data"]),
               timeout=30, what="machines offline")
    page.goto("/console/")
    expect(page.get_by_role("radio", name="My Machine")).to_be_checked()
    # the machine-state line under the machine choice says it, before anything is sent
    expect(page.locator("#machine-state")).to_have_text(OFFLINE)
    # the model last used stays pickable, so the person learns why it cannot answer
    expect(page.get_by_label("Model")).to_have_value("html-echo")
    tab.api_calls.clear()

    answer = send(page, "Are you there?")

    # only your machine serves html-echo, so while it is off prefer finds no such model (404
    # model_not_found); the console says so, and that your machine is offline
    expect(answer.locator(".error-sentence")).to_have_text(NOT_FOUND)
    expect(answer.locator(".error-extra")).to_have_text(OFFLINE)
    expect(answer.get_by_role("button", name="Retry")).to_be_enabled()
    assert [c[2].get("x-darkbloom-route") for c in chat_requests(tab)] == ["prefer"]

    # a person who last chatted on the bundled model comes back while their machine is off
    page.evaluate("localStorage.setItem('darkbloom.chatModel', 'smollm2-135m')")
    page.reload()
    expect(page.get_by_label("Model")).to_have_value("smollm2-135m")
    expect(page.locator("#machine-state")).to_have_text(OFFLINE)
    tab.api_calls.clear()
    answer = send(page, "And on the bundled model?")
    # the network has no machine for it either (503 model_unavailable)
    expect(answer.locator(".error-sentence")).to_have_text(UNAVAILABLE)
    expect(answer.locator(".error-extra")).to_have_text(OFFLINE)
    assert [c[2].get("x-darkbloom-route") for c in chat_requests(tab)] == ["prefer"]
    assert linked.balance() == CREDIT_MICRO_USD  # refused before anything was kept
    tab.shoot("chat-offline")
    page.goto("/console/machines")
    expect(page.locator(".machine[data-online=false]")).to_have_count(2)


def test_log_out_then_log_in_returns_to_the_page_asked_for(linked: Console) -> None:
    page = linked.page
    old_token = linked.tab.session_token()
    page.get_by_role("button", name="Log out").click()
    expect(page).to_have_url(re.compile(r"/console/login$"))
    assert page.evaluate("sessionStorage.getItem('darkbloom.session')") is None
    assert linked.api("GET", "/v1/payments/balance", token=old_token).status_code == 401

    page.goto("/console/link?code=ABCD-EFGH")
    expect(page).to_have_url(re.compile(r"/console/login\?next="))
    page.get_by_label("Email").fill(linked.email)
    page.get_by_label("Password").fill("not the password")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#auth-status")).to_contain_text("That email and password don't match")
    linked.tab.shoot("login")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(re.compile(r"/console/link\?code=ABCD-EFGH$"))
    expect(page.get_by_label("Code from darkbloom login")).to_have_value("ABCD-EFGH")
    assert linked.tab.errors == []
