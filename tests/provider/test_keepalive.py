"""How a node notices a connection that died without closing (src/darkbloom/provider/reconnect.py):
a WebSocket ping once a minute rather than websockets' default of every 20 s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect as websockets_connect

from darkbloom.provider import node as node_module
from darkbloom.provider.reconnect import ReconnectPolicy
from darkbloom.wire import protocol
from tests.provider.fake_coordinator import FakeCoordinator, running_node


async def test_the_node_pings_its_coordinator_once_a_minute(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """websockets' default is a ping every 20 s: at 10,000 idle nodes a third of the coordinator's idle CPU."""
    opened: list[tuple[dict[str, Any], Any]] = []

    def recording_connect(*args: Any, **kwargs: Any) -> Any:
        connecting = websockets_connect(*args, **kwargs)

        class Recorded:
            async def __aenter__(self) -> Any:
                ws = await connecting.__aenter__()
                opened.append((kwargs, ws))
                return ws

            async def __aexit__(self, *exc: Any) -> Any:
                return await connecting.__aexit__(*exc)
        return Recorded()

    monkeypatch.setattr(node_module, "connect", recording_connect)
    async with FakeCoordinator() as fake, running_node(fake.url, home, ReconnectPolicy()):
        conn = await fake.accept()
        await conn.recv_type(protocol.Register)
        kwargs, ws = opened[0]
        assert kwargs["ping_interval"] == 60.0 and kwargs["ping_timeout"] == 20.0
        assert ws.ping_interval == 60.0 and ws.ping_timeout == 20.0
