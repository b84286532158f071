"""Run the coordinator under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.logs import configure_logging


def build_server(settings: CoordinatorSettings, server_class: type[uvicorn.Server] = uvicorn.Server,
                 log_level: str = "info") -> uvicorn.Server:
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=log_level, access_log=False, ws_max_size=16 * 1024 * 1024,
                            ws_ping_interval=None, timeout_graceful_shutdown=5, lifespan="on")
    return server_class(config)


def run(settings: CoordinatorSettings) -> None:
    configure_logging()
    logging.getLogger("darkbloom").info("starting coordinator on %s:%d", settings.host, settings.port)
    build_server(settings).run()
