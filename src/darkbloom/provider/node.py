"""A provider node: dial the coordinator, register, answer challenges, heartbeat, serve sealed requests.

One connection at a time; every frame leaves through that connection's `Outbox`, so concurrent
requests never interleave writes. The coordinator's requests and their cancels are
`FleetRequests`'. Logs carry request ids and token counts, never prompt or completion text.

The backend is the one `config` names unless the caller passes one in (a test's wrapper, say).
Direct mode (`local_endpoint`, or `local_only` for `start --local`) serves an OpenAI-compatible
endpoint on this machine from the same backend, or from `direct_backend` when given. Fleet and
direct requests take their slots from one `Slots` of `max_concurrency`: a fleet request finding
none free is refused with 429, and heartbeats report both kinds as `active_requests`. With
`local_only` the node never dials a coordinator.

Registration's `loaded_models` and every heartbeat's `models` name the models in memory now (a
backend that loads on demand says which; any other has them all), and a load or unload sends a
heartbeat at once (several changes before it goes, one heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from darkbloom import paths
from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.wire.protocol import ModelInfo
from darkbloom.provider.backends import Backend, create_backend
from darkbloom.provider.backends.base import LoadsOnDemand, device_of
from darkbloom.provider.config import ProviderConfig, ws_url
from darkbloom.provider.direct.endpoint import LocalEndpoint
from darkbloom.provider.fleet_requests import FleetRequests
from darkbloom.provider.memory_fit import serving_concurrency
from darkbloom.provider.models import describe_models
from darkbloom.provider.outbox import BatchedWrites, Outbox, closed_outbox
from darkbloom.provider.reconnect import KEEPALIVE, ReconnectPolicy
from darkbloom.provider.registration import register_frame, save_certificate, version
from darkbloom.provider.slots import Slots
from darkbloom.provider.state import NodeState, write_state
from darkbloom.wire.runtime import runtime_hash

log = logging.getLogger(__name__)


class ProviderNode:
    def __init__(self, config: ProviderConfig, home: Path, backend: Backend | None = None, *,
                 local_only: bool = False, direct_backend: Backend | None = None,
                 reconnect: ReconnectPolicy | None = None) -> None:
        config.max_concurrency = serving_concurrency(config)  # what it serves, for everything that reads it
        self.config = config
        self.home = home
        self.local_only = local_only
        self.backend: Backend = backend if backend is not None else create_backend(self.config)
        self.direct_backend: Backend = direct_backend if direct_backend is not None else self.backend
        self.slots = Slots(self.config.max_concurrency)
        self.fleet = FleetRequests(self.config, self.backend, self.slots)
        self.local: LocalEndpoint | None = None
        self.runtime_hash = runtime_hash()
        self.identity: crypto.NodeIdentity | None = None
        self.models: list[ModelInfo] = []
        self.state = NodeState(coordinator_url="" if local_only else config.coordinator_url,
                               models=config.model_ids, private_only=config.private_only, local_only=local_only,
                               backend=config.backend, device=device_of(self.backend))
        self.reconnect = reconnect if reconnect is not None else ReconnectPolicy()
        self._outbox: Outbox = closed_outbox()
        self._registered = False
        self._models_changed = asyncio.Event()  # a model loaded or unloaded since the last heartbeat
        if isinstance(self.backend, LoadsOnDemand):
            self.backend.watch_loaded(self._models_changed.set)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, reconnecting when the connection ends (`reconnect.py`)."""
        if self.local_only or self.config.local_endpoint:
            self.local = LocalEndpoint(self.config, self.home, self.direct_backend, self.slots)
            self.local.open()  # before the model loads: a taken port fails at once
        try:
            if not self.local_only:
                self.identity = crypto.NodeIdentity.load_or_create(paths.identity_path(self.home))
                self.fleet.identity = self.identity
                described = await asyncio.to_thread(describe_models, self.config, self.home)
                self.models = [info for info, _ in described]
            self._set_state(connected=False)
            await self.backend.start()
            if self.direct_backend is not self.backend:
                await self.direct_backend.start()
            if self.local is not None:
                await self.local.start()
                self._set_state(local_url=self.local.base_url)
            if self.local_only:
                await stop.wait()
            else:
                await self._connect_loop(stop)
        finally:
            if self.local is not None:
                await self.local.stop()
            await self.fleet.cancel_all()
            await self.backend.close()
            if self.direct_backend is not self.backend:
                await self.direct_backend.close()
            self._set_state(connected=False, provider_id=None, local_url=None)
            log.info("node stopped")

    async def _connect_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            registered, close_code = await self._connect_once(stop)
            if stop.is_set():
                break
            wait = self.reconnect.delay(registered, close_code)
            log.info("reconnecting to the coordinator in %.1f s", wait)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def _connect_once(self, stop: asyncio.Event) -> tuple[bool, int | None]:
        """One connection, raced against `stop`: whether the coordinator registered us, and the
        code it closed the connection with (None: no connection, or no close frame)."""
        self._registered = False
        session = asyncio.create_task(self._session(), name="provider-session")
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            session.cancel()
            await asyncio.gather(session, stopper, return_exceptions=True)
            await self.fleet.cancel_all()
            self._set_state(connected=False, provider_id=None)
        close_code = None
        if not session.cancelled() and (exc := session.exception()) is not None:
            if isinstance(exc, (OSError, asyncio.TimeoutError, WebSocketException)):
                log.warning("coordinator connection failed: %s", exc)
            else:
                log.error("provider session crashed", exc_info=exc)
        elif not session.cancelled():
            close_code = session.result()
        return self._registered, close_code

    async def _session(self) -> int | None:
        """Connect, register and serve until the connection closes; the code it was closed with
        (1006: no close frame)."""
        url = ws_url(self.config)
        async with connect(url, max_size=protocol.MAX_REQUEST_FRAME_BYTES, compression=None, open_timeout=15,
                           close_timeout=5, user_agent_header=f"darkbloom-provider/{version()}",
                           create_connection=BatchedWrites, **KEEPALIVE) as ws:
            log.info("connected to %s", url)
            outbox = self._outbox = Outbox()
            assert self.identity is not None
            self._models_changed.clear()  # registration says what is loaded now
            await ws.send(protocol.dump(register_frame(self.config, self.home, self.identity, self.models,
                                                       self.runtime_hash, backend=self.backend,
                                                       loaded_models=self.loaded_models())))
            self._set_state(connected=True)
            tasks = [asyncio.create_task(outbox.write_to(ws)), asyncio.create_task(self._heartbeats()),
                     asyncio.create_task(self._reader(ws))]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                outbox.close()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    if not isinstance(exc, ConnectionClosed):
                        raise exc
                    log.info("coordinator closed the connection (%s)", exc)
        return ws.close_code

    # frames

    def _send(self, frame: BaseModel) -> None:
        self._outbox.send(frame)

    def loaded_models(self) -> list[str]:
        """The fleet backend's models in memory now."""
        if isinstance(self.backend, LoadsOnDemand):
            return self.backend.loaded_models()
        return self.config.model_ids

    async def _heartbeats(self) -> None:
        """Every `heartbeat_interval_secs`, and at once when a model loaded or unloaded."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._models_changed.wait(), self.config.heartbeat_interval_secs)
            self._models_changed.clear()
            active = self.slots.active  # fleet and direct-mode requests alike
            status = "idle" if active == 0 else "busy" if active >= self.config.max_concurrency else "serving"
            self._send(protocol.Heartbeat(status=status, active_requests=active, models=self.loaded_models()))

    async def _reader(self, ws: ClientConnection) -> None:
        async for raw in ws:
            try:
                frame = protocol.parse_coordinator_frame(raw)
            except protocol.FrameError as exc:
                log.warning("ignoring a frame from the coordinator: %s", exc.message)
                continue
            self._handle(frame)

    def _handle(self, frame: Any) -> None:
        if isinstance(frame, protocol.InferenceRequest):
            self.fleet.accept(frame, self._outbox)
        elif isinstance(frame, protocol.Cancel):
            self.fleet.cancel(frame.request_id)
        elif isinstance(frame, protocol.AttestationChallenge):
            self._answer_challenge(frame)
        elif isinstance(frame, protocol.Registered):
            self._registered = True
            self._outbox.merge_chunks = frame.chunk_arrays
            log.info("registered as %s (account %s, trust %s)", frame.provider_id, frame.account_id or "none",
                     frame.trust_level)
            self._set_state(provider_id=frame.provider_id, account_id=frame.account_id,
                            trust_level=frame.trust_level)
        elif isinstance(frame, protocol.TrustStatus):
            log.info("trust level now %s%s", frame.trust_level, f" ({frame.reason})" if frame.reason else "")
            if frame.certificate and self.identity is not None:
                save_certificate(self.home, frame.certificate, self.identity.identity_key_b64)
            self._set_state(trust_level=frame.trust_level)
        elif isinstance(frame, protocol.ErrorFrame):
            log.warning("coordinator error %s: %s", frame.code, frame.message)

    def _answer_challenge(self, frame: protocol.AttestationChallenge) -> None:
        assert self.identity is not None
        try:
            message = crypto.challenge_message(frame.nonce, frame.timestamp, self.runtime_hash)
        except ValueError:
            log.warning("ignoring an attestation challenge with an invalid nonce")
            return
        self._send(protocol.AttestationResponse(nonce=frame.nonce, signature=self.identity.sign(message),
                                                runtime_hash=self.runtime_hash))

    def _set_state(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self.state, key, value)
        try:
            write_state(self.home, self.state)
        except OSError as exc:
            log.warning("cannot write %s: %s", paths.node_state_path(self.home), exc)
