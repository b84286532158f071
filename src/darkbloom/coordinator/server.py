"""Run the coordinator under uvicorn."""

from __future__ import annotations

import gc
import logging

import uvicorn

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.websocket_protocol import SmallFrameWebSocketProtocol
from darkbloom.http_server import Server
from darkbloom.logs import configure_logging
from darkbloom.wire.protocol import SOCKET_MESSAGE_LIMIT


def build_server(settings: CoordinatorSettings, log_level: str = "info", own_signals: bool = True) -> Server:
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=log_level, access_log=False, ws_max_size=SOCKET_MESSAGE_LIMIT,
                            ws_ping_interval=None, timeout_graceful_shutdown=5, lifespan="on",
                            forwarded_allow_ips=settings.forwarded_allow_ips, ws=SmallFrameWebSocketProtocol)
    logging.getLogger("uvicorn.error").addFilter(_no_line_per_socket)
    # what the imports and the app made lives as long as the process: the cyclic collector never walks
    # it again (a full collection of it held the loop whenever a burst of chunks set one off)
    gc.collect()
    gc.freeze()
    return Server(config, own_signals=own_signals)


def _no_line_per_socket(record: logging.LogRecord) -> bool:
    """uvicorn and websockets log every WebSocket they open, twice: at 10,000 nodes that is 20,000
    lines per restart and a twentieth of a registration's CPU, saying nothing the coordinator's own
    line per registration does not."""
    return record.msg not in _PER_SOCKET


_PER_SOCKET = frozenset({'%s - "WebSocket %s" [accepted]', "connection open"})


def run(settings: CoordinatorSettings) -> None:
    configure_logging()
    server = build_server(settings)
    listening = server.config.bind_socket()  # logs "Uvicorn running on http://HOST:PORT"
    settings.port = int(listening.getsockname()[1])  # --port 0: the port the system chose, in links and logs
    logging.getLogger("darkbloom").info("starting coordinator on %s:%d", settings.host, settings.port)
    server.run(sockets=[listening])
