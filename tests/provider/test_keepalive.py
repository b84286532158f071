"""How a node notices a connection that died without closing (src/darkbloom/provider/reconnect.py):
the kernel's limit on unacknowledged data, and pings once a minute rather than websockets' default."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect as websockets_connect

from darkbloom.provider import node as node_module
from darkbloom.provider import reconnect
from darkbloom.provider.reconnect import ReconnectPolicy
from darkbloom.wire import protocol
from tests.provider.fake_coordinator import FakeCoordinator, running_node


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_USER_TIMEOUT is Linux's")
def test_unacknowledged_data_drops_the_connection_after_the_limit() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as sock:
        assert reconnect.limit_unacknowledged(sock)
        limit = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert limit == reconnect.UNACKNOWLEDGED_LIMIT * 1000


def test_without_a_socket_nothing_is_set() -> None:
    assert not reconnect.limit_unacknowledged(None)


async def test_the_node_pings_once_a_minute_and_limits_unacknowledged_data(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
        assert ws.ping_interval == 60.0
        if sys.platform.startswith("linux"):
            sock = ws.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000
