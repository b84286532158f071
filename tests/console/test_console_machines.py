"""The Machines page says, in a sentence, why a model earns nothing on a machine whose weights differ
from the ones the catalog pins (docs/models.md "Verified weights"): a coordinator whose catalog pins
`smollm2-135m`, and two scripted provider sessions linked to the signed-in account — one advertising
the pinned weights (and saying it runs on a Metal GPU), one other weights (and not saying where).
Each machine card says where the machine runs its models ("Runs on": backend · device)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from darkbloom.wire.protocol import Hardware
from tests.console.conftest import signed_in_tab
from tests.support.accounts import create_account, device_token
from tests.support.processes import Coordinator, start_coordinator
from tests.support.raw_provider import ThreadedRaw

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
PINNED = "sha256:" + "5e" * 32
OTHER = "sha256:" + "0b" * 32
SENTENCE = (f"{MODEL}: this machine's weights differ from the network's (sha256 5e5e5e5e5e5e…), so it serves "
            "only your own requests for it and earns nothing.")


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("console-machines")
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [{"id": MODEL, "input_price": 50_000, "output_price": 200_000,
                                               "weight_hash": PINNED}]}))
    coordinator = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}",
                                    "--catalog", str(catalog))
    try:
        yield coordinator
    finally:
        coordinator.stop()


def test_a_machine_with_other_weights_says_why_it_earns_nothing(browser: Any, coord: Coordinator) -> None:
    owner = create_account(coord)
    machines = [ThreadedRaw(coord.base_url, device_token(coord, owner), model_fields={"weight_hash": weights},
                            hardware=hardware)
                for weights, hardware in ((PINNED, Hardware(device="metal", backend="llama-cpp")), (OTHER, None))]
    context, tab = signed_in_tab(browser, coord.base_url, owner.session, owner.email)
    try:
        page = tab.page
        page.goto("/console/machines")
        expect(page.locator(".machine[data-online=true]")).to_have_count(2)
        notes = page.locator(".machine-note.unverified")
        expect(notes).to_have_count(1)
        expect(notes).to_have_text(SENTENCE)
        expect(notes).to_have_attribute("data-model", MODEL)
        other_card = page.locator(".machine", has=notes)
        expect(other_card.locator(".facts")).to_contain_text(MODEL)
        runs_on = page.locator(".machine", has_not=notes).locator("dt:text-is('Runs on') + dd")
        expect(runs_on).to_have_text("llama.cpp · Metal GPU")  # where it said it runs its models
        expect(other_card.locator("dt:text-is('Runs on')")).to_have_count(0)  # it did not say
        assert sorted(call[1] for call in tab.api_calls if "/stats" not in call[1]) == [
            "/v1/me/providers", "/v1/models/catalog"]
        tab.shoot("machines-unverified")
    finally:
        context.close()
        for machine in machines:
            machine.close()
    assert tab.errors == []


def test_a_machine_card_says_which_engine_runs_its_models_and_where(browser: Any, coord: Coordinator) -> None:
    owner = create_account(coord)
    where = (Hardware(device="metal", backend="mlx"), Hardware(device="cpu", backend="mlx"),
             Hardware(device="cuda", backend="llama-cpp"))
    machines = [ThreadedRaw(coord.base_url, device_token(coord, owner), model_fields={"weight_hash": PINNED},
                            hardware=hardware) for hardware in where]
    context, tab = signed_in_tab(browser, coord.base_url, owner.session, owner.email)
    try:
        page = tab.page
        page.goto("/console/machines")
        expect(page.locator(".machine[data-online=true]")).to_have_count(3)
        runs_on = page.locator(".machine dt:text-is('Runs on') + dd")
        expect(runs_on).to_have_count(3)
        assert sorted(runs_on.all_inner_texts()) == ["MLX · Apple M-series GPU", "MLX · CPU", "llama.cpp · CUDA GPU"]
    finally:
        context.close()
        for machine in machines:
            machine.close()
    assert tab.errors == []
