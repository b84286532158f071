"""The Machines page's last 24 hours (requests per hour as a chart and a table, earnings, why public
requests went elsewhere, in sentences) and Usage & billing's spend and tokens per day with the CSV
download, against a real coordinator: the signed-in account's private machine serves its own
requests while another account's machine serves the public ones, including the account's."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from tests.console.conftest import PHONE, signed_in_tab
from tests.support.accounts import Account, create_account, device_token
from tests.support.processes import Coordinator, start_coordinator, wait_until
from tests.support.raw_provider import ThreadedRaw

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@dataclass
class World:
    coord: Coordinator
    owner: Account
    mine: ThreadedRaw
    machine_id: str
    passed_over: int


def _chat(coord: Coordinator, token: str, **headers: str) -> httpx.Response:
    response = httpx.post(coord.api_url + "/chat/completions", json=BODY, timeout=60,
                          headers={"Authorization": f"Bearer {token}", **headers})
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("console-insight")
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}",
                              env={"DARKBLOOM_INSIGHT_INTERVAL": "0.5"})
    raws = []
    try:
        owner = create_account(coord, credit_micro_usd=10_000_000)
        mine = ThreadedRaw(coord.base_url, device_token(coord, owner), answer="Mine.", private_only=True)
        raws.append(mine)
        host = create_account(coord)
        raws.append(ThreadedRaw(coord.base_url, device_token(coord, host), answer="Served.", max_concurrency=4))
        stranger = create_account(coord, credit_micro_usd=10_000_000)
        for _ in range(2):
            _chat(coord, owner.api_key, **{"X-Darkbloom-Route": "self"})
        for token in (stranger.api_key, stranger.api_key, owner.api_key):
            assert _chat(coord, token).headers["x-provider-id"] != mine.session_id
        listing = httpx.get(coord.api_url + "/me/providers", headers={"Authorization": f"Bearer {owner.session}"})
        machine_id = next(m["id"] for m in listing.json()["data"] if m["session_id"] == mine.session_id)

        def counted() -> int | None:
            return _stats(coord, owner, machine_id)["passed_over"]["private_only"] or None
        wait_until(counted, timeout=20, what="passed over counted")
        yield World(coord, owner, mine, machine_id, int(counted() or 0))
    finally:
        for raw in raws:
            raw.close()
        coord.stop()


def _stats(coord: Coordinator, owner: Account, machine_id: str) -> dict[str, Any]:
    """The owner's machine's last 24 hours, as the Machines page reads them."""
    response = httpx.get(coord.api_url + f"/me/providers/{machine_id}/stats",
                         headers={"Authorization": f"Bearer {owner.session}"})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _no_horizontal_overflow(page: Any) -> None:
    for size in (PHONE, {"width": 1280, "height": 900}):
        page.set_viewport_size(size)
        page.wait_for_timeout(100)
        assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth"), size


def test_machines_page_draws_the_last_24_hours_and_says_why(browser: Any, world: World) -> None:
    w = world
    context, tab = signed_in_tab(browser, w.coord.base_url, w.owner.session, w.owner.email)
    try:
        page = tab.page
        page.goto("/console/machines")
        card = page.locator(f".machine[data-id={w.machine_id}]")
        chart = card.locator("figure.chart")
        expect(chart.locator("svg[role=img]")).to_be_visible()
        expect(chart.locator("figcaption")).to_have_text("Requests per hour")
        # the two owned requests, in one hour (two when the run straddled an hour's turn)
        hours = [h for h in _stats(w.coord, w.owner, w.machine_id)["hourly"] if h["owned"]]
        assert sum(h["owned"] for h in hours) == 2 and len(hours) in (1, 2), hours
        expect(chart.locator("rect.chart-bar.s-owned")).to_have_count(len(hours))
        expect(card.locator(".insight-facts")).to_contain_text("2 (2 yours, 0 shared, 0 from the network)")
        expect(card.locator(".insight-facts")).to_contain_text("$0.00")
        expect(card.locator(".passed-over p")).to_have_text(
            [f"{w.passed_over} public requests went to other machines because it serves only you (private)."])
        chart.locator("details summary").click()
        rows = chart.locator("table.chart-table tbody tr")
        expect(rows).to_have_count(len(hours))
        expect(rows.locator("td")).to_have_text([str(cell) for h in hours for cell in (h["owned"], 0, 0)])
        assert tab.calls(f"/v1/me/providers/{w.machine_id}/stats")
        _no_horizontal_overflow(page)
        tab.shoot("machines-insight")
    finally:
        context.close()
    assert tab.errors == []


def test_usage_page_draws_spend_and_tokens_per_day_and_downloads_the_csv(browser: Any, world: World) -> None:
    w = world
    context, tab = signed_in_tab(browser, w.coord.base_url, w.owner.session, w.owner.email)
    try:
        page = tab.page
        page.goto("/console/usage")
        spend = page.locator("#spend-chart")
        expect(spend.locator("rect.chart-bar")).to_have_count(1)   # the day of the one public request
        daily = httpx.get(w.coord.api_url + "/payments/usage/daily", params={"days": 30},
                          headers={"Authorization": f"Bearer {w.owner.session}"}).json()["data"]
        used_on = [day for day in daily if day["prompt_tokens"]]  # one day (two if the run straddled 00:00 UTC)
        assert sum(day["requests"] for day in used_on) == 3 and len(used_on) in (1, 2), used_on
        expect(page.locator("#tokens-chart rect.chart-bar.s-in")).to_have_count(len(used_on))
        expect(spend.locator(".chart-summary")).to_contain_text("over 3 requests in the last 30 days")
        with page.expect_download() as info:
            page.get_by_role("button", name="Download CSV").click()
        download = info.value
        assert download.suggested_filename.startswith("darkbloom-usage-")
        lines = list(csv.DictReader(io.StringIO(open(download.path(), encoding="utf-8").read())))
        assert len(lines) == 3 and {line["routed"] for line in lines} == {"owned", "fleet"}
        [call] = tab.calls("/v1/payments/usage.csv")
        assert call[2]["authorization"] == f"Bearer {w.owner.session}"
        expect(page.locator("#usage-status")).to_contain_text("saved as a CSV file")
        _no_horizontal_overflow(page)
        tab.shoot("usage-charts")
    finally:
        context.close()
    assert tab.errors == []
