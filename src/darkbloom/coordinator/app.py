"""ASGI app factory: routes, middleware, lifespan (start and stop of everything)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.consumer_key import load_or_create_key
from darkbloom.coordinator.console import routes as console_routes
from darkbloom.coordinator.fleet.connection import SERVICE_RESTART
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.http.body_limit import UPLOAD_FRAMING, BodyLimitMiddleware
from darkbloom.coordinator.inference.disconnect import ClientDisconnected
from darkbloom.coordinator.http.cors import add_cors
from darkbloom.coordinator.http.errors import install_handlers
from darkbloom.coordinator.http.allowed_methods import install_allowed_methods
from darkbloom.coordinator.http.openapi.document import install_openapi
from darkbloom.coordinator.batches.runner import BatchRunner
from darkbloom.coordinator.http.routes import (account, admin, batches, device, files, health, inference, keys, payments,
                                             provider_ws, shares)
from darkbloom.coordinator.identity import auth_invalidation
from darkbloom.coordinator.money import reconciliation
from darkbloom.coordinator.money.ratelimit import create_rate_limiter
from darkbloom.coordinator.routing import live_catalog
from darkbloom.coordinator.services import Services
from darkbloom.store import create_engine, migrate, notices

log = logging.getLogger("darkbloom.coordinator")


def create_app(settings: CoordinatorSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.database_url)
        await migrate(engine)
        services = Services(settings=settings, engine=engine, registry=Registry(),
                            rate_limiter=create_rate_limiter(settings.redis_url))
        app.state.services = services
        await live_catalog.load_catalog(services)
        services.consumer_key = await load_or_create_key(engine)
        await reconciliation.register_instance(services)
        await reconciliation.reconcile_abandoned(services)
        background = [asyncio.create_task(services.registry.evict_silent(settings.eviction_interval,
                                                                          settings.heartbeat_timeout)),
                      asyncio.create_task(reconciliation.heartbeat_forever(services)),
                      asyncio.create_task(services.queues.drain_forever()),
                      asyncio.create_task(BatchRunner(services).run_forever())]
        if engine.dialect.name == "postgresql":  # other coordinators may share the database
            listener = notices.Listener(engine)
            auth_invalidation.subscribe(services, listener)
            live_catalog.subscribe(services, listener)
            background.append(asyncio.create_task(listener.run()))
        services.machine_book.start()
        services.insight.start()
        if settings.nats_url:
            from darkbloom.coordinator.fabric.replica import Fabric  # only replicas pay for NATS

            services.fabric = Fabric(services)
            await services.fabric.start()
        log.info("coordinator ready on %s (database %s)", settings.base_url, engine.url.render_as_string())
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            for session in services.registry.held_here():
                session.close(SERVICE_RESTART)
            if services.fabric is not None:
                await services.fabric.stop()
            await services.drain(timeout=settings.cancel_grace + 5)
            await services.rate_limiter.close()
            await services.auth_cache.close()
            await services.ledger.close()  # commits what is still queued
            await services.machine_book.close()  # writes what the closed sessions last said
            await services.insight.close()  # adds what was counted since the last flush
            await engine.dispose()

    # no trailing-slash redirects: Starlette writes their Location from the request's Host header
    app = FastAPI(title="Darkbloom coordinator", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None, redirect_slashes=False, **_NO_TELEMETRY)
    # an uploaded file may be larger than a request body (its multipart framing aside)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       uploads={"/v1/files": settings.batch_max_file_bytes + UPLOAD_FRAMING})
    add_cors(app, settings.cors_origins)  # outside the body limit: preflights never reach it or routes
    install_handlers(app)
    install_allowed_methods(app)  # OPTIONS → 204 and every 405 with the full Allow
    install_openapi(app)  # GET /openapi.json: bodies, every response, Self-Route headers
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    inference.add_inference_routes(app)
    for module in (health, inference, account, payments, keys, shares, files, batches, device, admin, console_routes):
        app.include_router(module.router)
    app.add_middleware(provider_ws.ProviderSocketFirst)  # added last: the outermost
    return app


# FastAPI releases with native OpenTelemetry look up the global tracer, meter and logger providers on
# every request to decide whether to report it (~3 % of the coordinator's CPU on the relay path); the
# coordinator's metrics are Prometheus's (/metrics), so that is off where the option exists.
_NO_TELEMETRY: dict[str, Any] = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                                 if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


async def _client_gone(_request: Request, _exc: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": "client disconnected", "type": "client_disconnected",
                                   "code": "client_disconnected", "param": None}}, status_code=499)
