"""Console pages without a node: expired link codes, one request per data item, the machine-state
polling interval, labels, keyboard use, phone width and the Retry-After countdown. The coordinator
here issues device codes that expire at once (`--device-code-ttl 0`), which only the expired-code
test relies on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from tests.console.conftest import PHONE, open_tab, signed_in_tab
from tests.support.accounts import Account, create_account
from tests.support.processes import Coordinator, start_coordinator, wait_until

pytestmark = pytest.mark.e2e

# What each page may ask the API for on load: one request per data item, never one per row.
PAGE_REQUESTS = {
    "/console/": {"/v1/models", "/v1/me/providers", "/v1/me/self-route-models"},  # My Machine on
    "/console/keys": {"/v1/keys"},
    "/console/machines": {"/v1/me/providers"},
    "/console/sharing": {"/v1/shares", "/v1/me/providers", "/v1/me"},  # and one /usage per share (none here)
    "/console/usage": {"/v1/payments/balance", "/v1/payments/usage", "/v1/payments/usage/daily",
                       "/v1/provider/earnings"},
    "/console/batches": {"/v1/batches"},
    "/console/link": set(),
}


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("console-pages")
    coordinator = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}",
                                    "--device-code-ttl", "0")
    try:
        yield coordinator
    finally:
        coordinator.stop()


@pytest.fixture(scope="module")
def account(coord: Coordinator) -> Account:
    owner = create_account(coord)
    for name in ("second", "third"):
        httpx.post(coord.api_url + "/keys", json={"name": name}, headers=owner.headers()).raise_for_status()
    return owner


@pytest.fixture
def tab(browser: Any, coord: Coordinator, account: Account) -> Iterator[Any]:
    # the former My Machine switch's preference: the chat reads it as My Machine chosen
    context, tab = signed_in_tab(browser, coord.base_url, account.session, account.email,
                                 local={"darkbloom.myMachine": "true"})
    try:
        yield tab
    finally:
        context.close()
    assert tab.errors == []


def test_link_page_says_an_expired_code_needs_a_new_login(tab: Any, coord: Coordinator) -> None:
    code = httpx.post(coord.api_url + "/device/code").json()["user_code"]
    page = tab.page
    page.goto(f"/console/link?code={code}")
    expect(page.get_by_label("Code from darkbloom login")).to_have_value(code)
    expect(page.get_by_role("button", name="Approve and link")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("#link-status [data-code=expired_code]")).to_have_text(
        "That code has expired — run darkbloom login again on your machine for a new one.")
    expect(page.locator("#link-status code")).to_have_text("darkbloom login")


def test_each_page_asks_once_for_each_kind_of_data(tab: Any) -> None:
    page = tab.page
    for path, expected in PAGE_REQUESTS.items():
        tab.api_calls.clear()
        page.goto(path)
        page.wait_for_load_state("networkidle")
        asked = [call[1].split("?")[0] for call in tab.api_calls]
        assert sorted(asked) == sorted(expected), (path, asked)
    page.goto("/console/keys")
    expect(page.locator("#key-list .key")).to_have_count(3)


# Each /v1/me/providers request's page time (Date.now() under Playwright's clock), recorded in the page
RECORD_POLLS = """(() => { const fetch = window.fetch; window.__polls = [];
  window.fetch = (input, init) => {
    if (String(input.url ?? input).startsWith("/v1/me/providers")) window.__polls.push(Date.now());
    return fetch(input, init);
  }; })()"""


def test_machine_state_is_polled_at_most_every_ten_seconds(tab: Any) -> None:
    page = tab.page
    page.add_init_script(RECORD_POLLS)
    page.clock.install()
    page.goto("/console/machines")
    expect(page.locator("#machine-list")).to_contain_text("No machines linked yet")

    def polls() -> list[int]:
        return list(page.evaluate("window.__polls"))

    def polled(count: int) -> bool:
        page.clock.run_for(1_000)  # page time runs ahead of the wall clock; gaps are read in page time
        return len(polls()) >= count

    for count in (2, 3, 4):
        wait_until(lambda n=count: polled(n), timeout=30, what=f"poll {count}")
    times = polls()
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    assert gaps and all(gap >= 10_000 for gap in gaps), f"polled sooner than every 10 s: {gaps} ms apart"


def _unlabelled(page: Any) -> list[str]:
    return page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(el => el.type !== 'hidden')
        .filter(el => el.tagName === 'BUTTON'
            ? !(el.textContent.trim() || el.getAttribute('aria-label'))
            : !(el.labels.length || el.getAttribute('aria-label') || el.getAttribute('aria-labelledby')))
        .map(el => el.outerHTML.slice(0, 120))""")


def _check_page(page: Any, path: str) -> None:
    assert _unlabelled(page) == [], path
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"{path} is {width} px wide at phone width"


def test_every_control_is_labelled_and_pages_fit_a_phone(tab: Any, browser: Any, coord: Coordinator) -> None:
    page = tab.page
    page.set_viewport_size(PHONE)
    for path in PAGE_REQUESTS:
        page.goto(path)
        page.wait_for_load_state("networkidle")
        if path == "/console/keys":
            page.get_by_role("button", name="Create key").click()
            expect(page.locator("#model-choices")).not_to_be_empty()
        if path == "/console/sharing":
            page.get_by_role("button", name="Share machines").click()
            expect(page.locator("#machine-choices")).not_to_be_empty()
        _check_page(page, path)
    context, signed_out = open_tab(browser, coord.base_url)
    try:
        signed_out.page.set_viewport_size(PHONE)
        for path in ("/console/login", "/console/signup"):
            signed_out.page.goto(path)
            expect(signed_out.page.get_by_label("Email")).to_be_visible()
            _check_page(signed_out.page, path)
    finally:
        context.close()


def test_keyboard_reaches_the_machine_choice_with_a_visible_focus_ring(tab: Any) -> None:
    page = tab.page
    page.goto("/console/")
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    for _ in range(20):
        if page.evaluate("document.activeElement.name") == "route":
            break
        page.keyboard.press("Tab")
    mine = page.get_by_role("radio", name="My Machine")
    expect(mine).to_be_focused()  # the chosen one of the group: the old switch's "true"
    expect(mine).to_be_checked()
    assert page.evaluate("getComputedStyle(document.querySelector('#route-prefer + span')).outlineStyle") == "solid"
    expect(page.get_by_role("group", name="Run on")).to_be_visible()
    page.keyboard.press("ArrowRight")
    shared = page.get_by_role("radio", name="Shared machines")
    expect(shared).to_be_focused()
    expect(shared).to_be_checked()
    assert page.evaluate("localStorage.getItem('darkbloom.route')") == "shared"
    assert page.evaluate("localStorage.getItem('darkbloom.myMachine')") is None
    expect(page.locator("#machine-state")).to_contain_text("Nobody has shared a machine with you yet")
    page.keyboard.press("ArrowRight")
    expect(page.get_by_role("radio", name="Network")).to_be_checked()
    assert page.evaluate("localStorage.getItem('darkbloom.route')") == "network"
    expect(page.locator("#machine-state")).to_contain_text("Answers come from the network")


def test_keyboard_opens_and_closes_the_key_form(tab: Any) -> None:
    page = tab.page
    page.goto("/console/keys")
    create = page.get_by_role("button", name="Create key")
    create.focus()
    page.keyboard.press("Enter")
    expect(page.locator("#key-form-title")).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.get_by_label("Name")).to_be_focused()
    page.keyboard.press("Escape")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(create).to_be_focused()


def test_console_is_served_with_a_strict_content_security_policy(coord: Coordinator) -> None:
    page = httpx.get(coord.base_url + "/console/keys")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert page.headers["x-frame-options"] == "DENY" and page.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in page.text  # module files only, nothing inline
    assert httpx.get(coord.base_url + "/console").status_code == 308
    script = httpx.get(coord.base_url + "/console/static/chat.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert httpx.get(coord.base_url + "/console/static/chat.js",
                     headers={"If-None-Match": script.headers["etag"]}).status_code == 304
    for missing in ("/console/static/app.py", "/console/static/..%2Froutes%2Fconsole.py", "/console/admin"):
        assert httpx.get(coord.base_url + missing).status_code == 404, missing


def test_rate_limited_chat_says_when_to_retry_and_counts_down(tab: Any) -> None:
    """A refused rate limit refunds its token, so without a serving node the coordinator cannot be
    driven to 429 here; this test stubs the one response (the coordinator's exact 429 envelope and
    headers, from admission.py) to check what the person sees. (The console's chat sends only
    prefer or no route header, and neither is answered with machine_offline's Retry-After, so this
    stub is where the countdown is checked.)"""
    page = tab.page
    page.goto("/console/link")
    page.evaluate("localStorage.setItem('darkbloom.chatModel', 'smollm2-135m')")  # the model used last time
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=429, content_type="application/json", headers={"Retry-After": "4"},
        body=json.dumps({"error": {"message": "Rate limit reached: your account allows 60 requests per minute. "
                                              "Retry after 4 s.", "type": "rate_limit_exceeded",
                                   "code": "rate_limit_exceeded", "param": "requests"}})))
    page.goto("/console/")
    page.get_by_role("radio", name="Network").check()
    expect(page.get_by_label("Model")).to_have_value("smollm2-135m")
    page.get_by_label("Message").fill("hello")
    page.get_by_label("Message").press("Enter")
    answer = page.locator(".turn.assistant")
    expect(answer.locator(".error-sentence")).to_have_text(
        "You're sending requests faster than your limit allows — wait for the countdown, then retry.")
    expect(answer.locator(".error-detail")).to_contain_text("your account allows 60 requests per minute")
    retry = answer.get_by_role("button", name="Retry")
    expect(answer.locator(".countdown")).to_have_text(re.compile(r"^Retry in [34] s$"))
    expect(retry).to_be_disabled()
    expect(answer.locator(".countdown")).to_have_text("You can retry now.", timeout=8000)
    expect(retry).to_be_enabled()
    page.unroute("**/v1/chat/completions")
    retry.click()
    # the real coordinator now answers: this zero-balance account is out of credit
    expect(page.locator(".turn.assistant .error-sentence")).to_have_text(
        "You're out of credit — add credit to keep chatting. My Machine needs credit too: the cost is held "
        "up front and refunded when your machine answers.")
