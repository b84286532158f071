"""A provider node: dial the coordinator, register, answer challenges, heartbeat, serve sealed requests.

One connection at a time; every frame leaves through a single writer task so concurrent requests
never interleave writes. Logs carry request ids and token counts, never prompt or completion text.

A `cancel` from the coordinator (its client went away) stops the request, and once the backend has
stopped generating (waited for at most `cancel_grace` seconds) the node reports the tokens used so
far in one `inference_complete`, so the coordinator can settle the partial work. That report is the
only frame sent for the request after the cancel; every other frame for it is dropped, including
any already queued for the writer.

Direct mode (`local_endpoint`, or `local_only` for `start --local`) serves an OpenAI-compatible
endpoint on this machine from the same backend. Fleet and direct requests take their slots from one
`Slots` of `max_concurrency`: a fleet request finding none free is refused with 429, and heartbeats
report both kinds as `active_requests`. With `local_only` the node never dials a coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from darkbloom import crypto, paths, protocol
from darkbloom.protocol import ModelInfo
from darkbloom.provider.backends import Backend, BackendError, create_backend
from darkbloom.provider.backends.base import UsageMeter, is_usage_chunk
from darkbloom.provider.config import ProviderConfig, ws_url
from darkbloom.provider.local_endpoint import LocalEndpoint
from darkbloom.provider.models import describe_models
from darkbloom.provider.registration import register_frame, save_certificate, version
from darkbloom.provider.slots import Slots
from darkbloom.provider.state import NodeState, write_state
from darkbloom.runtime import runtime_hash

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    request_id: str
    meter: UsageMeter = field(default_factory=UsageMeter, repr=False)  # the backend's counts so far
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    settling: asyncio.Task[None] | None = field(default=None, repr=False)  # after a cancel: the usage report
    cancelled: bool = False  # once set, nothing more is sent for this request but the usage report on cancel


class ProviderNode:
    reconnect_base = 1.0
    reconnect_max = 30.0
    cancel_grace = 5.0  # after a cancel, how long to wait for the backend to stop before reporting usage

    def __init__(self, config: ProviderConfig, home: Path, backend: Backend | None = None, *,
                 local_only: bool = False) -> None:
        self.config = config
        self.home = home
        self.local_only = local_only
        self.backend: Backend = backend if backend is not None else create_backend(config)
        self.slots = Slots(config.max_concurrency)
        self.local: LocalEndpoint | None = None
        self.runtime_hash = runtime_hash()
        self.identity: crypto.NodeIdentity | None = None
        self.models: list[ModelInfo] = []
        self.state = NodeState(coordinator_url="" if local_only else config.coordinator_url,
                               models=config.model_ids, private_only=config.private_only, local_only=local_only)
        self._jobs: dict[str, _Job] = {}
        self._outbox: asyncio.Queue[tuple[_Job | None, str]] | None = None
        self._registered = False

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, reconnecting with jittered exponential backoff."""
        if self.local_only or self.config.local_endpoint:
            self.local = LocalEndpoint(self.config, self.home, self.backend, self.slots)
            self.local.open()  # before the model loads: a taken port fails at once
        try:
            if not self.local_only:
                self.identity = crypto.NodeIdentity.load_or_create(paths.identity_path(self.home))
                described = await asyncio.to_thread(describe_models, self.config, self.home)
                self.models = [info for info, _ in described]
            self._set_state(connected=False)
            await self.backend.start()
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
            await self._cancel_jobs()
            await self.backend.close()
            self._set_state(connected=False, provider_id=None, local_url=None)
            log.info("node stopped")

    async def _connect_loop(self, stop: asyncio.Event) -> None:
        delay = self.reconnect_base
        while not stop.is_set():
            registered = await self._connect_once(stop)
            if stop.is_set():
                break
            if registered:
                delay = self.reconnect_base
            wait = random.uniform(delay / 2, delay)
            log.info("reconnecting to the coordinator in %.1f s", wait)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            delay = min(delay * 2, self.reconnect_max)

    async def _connect_once(self, stop: asyncio.Event) -> bool:
        """One connection, raced against `stop`; True when the coordinator registered us."""
        self._registered = False
        session = asyncio.create_task(self._session(), name="provider-session")
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            session.cancel()
            await asyncio.gather(session, stopper, return_exceptions=True)
            await self._cancel_jobs()
            self._set_state(connected=False, provider_id=None)
        if not session.cancelled() and (exc := session.exception()) is not None:
            if isinstance(exc, (OSError, asyncio.TimeoutError, WebSocketException)):
                log.warning("coordinator connection failed: %s", exc)
            else:
                log.error("provider session crashed", exc_info=exc)
        return self._registered

    async def _session(self) -> None:
        url = ws_url(self.config)
        async with connect(url, max_size=protocol.MAX_FRAME_BYTES, compression=None, open_timeout=15,
                           close_timeout=5, user_agent_header=f"darkbloom-provider/{version()}") as ws:
            log.info("connected to %s", url)
            self._outbox = asyncio.Queue()
            assert self.identity is not None
            await ws.send(protocol.dump(register_frame(self.config, self.home, self.identity, self.models,
                                                       self.runtime_hash)))
            self._set_state(connected=True)
            tasks = [asyncio.create_task(self._writer(ws, self._outbox)), asyncio.create_task(self._heartbeats()),
                     asyncio.create_task(self._reader(ws))]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._outbox = None
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    if not isinstance(exc, ConnectionClosed):
                        raise exc
                    log.info("coordinator closed the connection (%s)", exc)

    # frames

    async def _writer(self, ws: ClientConnection, outbox: asyncio.Queue[tuple[_Job | None, str]]) -> None:
        """The only sender. A frame queued with its job is dropped if the job was cancelled meanwhile;
        one queued with None (not a request's, or the usage report after a cancel) always goes."""
        while True:
            job, text = await outbox.get()
            if job is None or not job.cancelled:
                await ws.send(text)

    def _send(self, frame: BaseModel, job: _Job | None = None) -> None:
        if self._outbox is not None and (job is None or not job.cancelled):
            self._outbox.put_nowait((job, protocol.dump(frame)))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_secs)
            active = self.slots.active  # fleet and direct-mode requests alike
            status = "idle" if active == 0 else "busy" if active >= self.config.max_concurrency else "serving"
            self._send(protocol.Heartbeat(status=status, active_requests=active, models=self.config.model_ids))

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
            self._accept(frame)
        elif isinstance(frame, protocol.Cancel):
            job = self._jobs.get(frame.request_id)
            if job is not None and job.task is not None and not job.cancelled:
                log.info("request %s cancelled by the coordinator", frame.request_id)
                job.cancelled = True
                job.task.cancel()
                job.settling = asyncio.create_task(self._settle_cancelled(job, self._outbox),
                                                   name=f"settle-{frame.request_id}")
        elif isinstance(frame, protocol.AttestationChallenge):
            self._answer_challenge(frame)
        elif isinstance(frame, protocol.Registered):
            self._registered = True
            log.info("registered as %s (account %s, trust %s)", frame.provider_id, frame.account_id or "none",
                     frame.trust_level)
            self._set_state(provider_id=frame.provider_id, account_id=frame.account_id,
                            trust_level=frame.trust_level)
        elif isinstance(frame, protocol.TrustStatus):
            log.info("trust level now %s%s", frame.trust_level, f" ({frame.reason})" if frame.reason else "")
            if frame.certificate:
                save_certificate(self.home, frame.certificate)
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

    # requests

    def _accept(self, frame: protocol.InferenceRequest) -> None:
        request_id = frame.request_id
        if request_id in self._jobs:
            log.warning("request %s is already running; duplicate ignored", request_id)
            return
        if not self.slots.try_acquire():
            log.info("request %s refused: at max_concurrency %d", request_id, self.config.max_concurrency)
            self._send(protocol.InferenceError(
                request_id=request_id, status_code=429,
                message=f"this node is busy (max_concurrency {self.config.max_concurrency}); retry elsewhere"))
            return
        job = _Job(request_id)
        self._jobs[request_id] = job
        job.task = asyncio.create_task(self._serve(job, frame), name=f"request-{request_id}")

    async def _settle_cancelled(self, job: _Job, outbox: asyncio.Queue[tuple[_Job | None, str]] | None) -> None:
        """After the coordinator's cancel: let the request task end, wait (bounded) for the backend to
        stop generating, then report the tokens used so far. The job keeps its slot until then."""
        assert job.task is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cancel_grace
        try:
            await asyncio.wait({job.task}, timeout=self.cancel_grace)
            stopped = job.task.done() and await job.meter.stopped(max(0.0, deadline - loop.time()))
            if not stopped:
                log.warning("request %s: the backend did not stop within %.0f s; reporting the usage so far",
                            job.request_id, self.cancel_grace)
            usage = protocol.Usage(prompt_tokens=job.meter.prompt_tokens,
                                   completion_tokens=job.meter.completion_tokens)
            if outbox is not None and outbox is self._outbox:  # still the connection the cancel came on
                # Queued without its job, so the writer sends it although the job is cancelled.
                outbox.put_nowait((None, protocol.dump(protocol.InferenceComplete(request_id=job.request_id,
                                                                                  usage=usage))))
            log.info("request %s cancelled after %d prompt + %d completion tokens", job.request_id,
                     usage.prompt_tokens, usage.completion_tokens)
        finally:
            self._free(job)

    async def _serve(self, job: _Job, frame: protocol.InferenceRequest) -> None:
        request_id = job.request_id
        try:
            body, sealer = self._open_request(frame)
            model_id = body.get("model")
            if model_id not in self.config.model_ids:
                raise BackendError(404, f"model {model_id!r} is not served by this node")
            self._send(protocol.InferenceAccepted(request_id=request_id), job)
            log.info("request %s accepted for %s", request_id, model_id)
            usage = await self._relay(job, sealer, self.backend.stream_chat(model_id, body, job.meter))
            self._send(protocol.InferenceComplete(request_id=request_id, usage=usage), job)
            log.info("request %s complete: %d prompt + %d completion tokens", request_id,
                     usage.prompt_tokens, usage.completion_tokens)
        except BackendError as exc:
            log.warning("request %s failed with status %d", request_id, exc.status_code)
            # inference_error is not sealed: backends put only sentences of their own in exc.message,
            # never prompt or completion text, nor an upstream's or a library's free-text error.
            self._send(protocol.InferenceError(request_id=request_id, status_code=exc.status_code,
                                               message=exc.message), job)
        except asyncio.CancelledError:
            job.cancelled = True
            log.info("request %s stopped", request_id)
            raise
        except Exception:
            log.exception("request %s failed", request_id)
            self._send(protocol.InferenceError(request_id=request_id, status_code=500,
                                               message="the provider failed while serving this request"), job)
        finally:
            if job.settling is None:  # else the settle frees the slot
                self._free(job)

    def _open_request(self, frame: protocol.InferenceRequest) -> tuple[dict[str, Any], crypto.Sealer]:
        """The plaintext OpenAI body, and a sealer to the request's ephemeral key for every reply chunk."""
        assert self.identity is not None
        try:
            plaintext = crypto.open_envelope(frame.encrypted_body, self.identity.encryption_key)
            sealer = crypto.Sealer(crypto.public_key_from_b64(frame.encrypted_body.ephemeral_public_key))
        except crypto.DecryptionError:
            raise BackendError(400, "the request body does not open with this node's key") from None
        try:
            body = json.loads(plaintext)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise BackendError(400, "the request body must be a JSON object")
        return body, sealer

    async def _relay(self, job: _Job, sealer: crypto.Sealer,
                     stream: AsyncIterator[dict[str, Any]]) -> protocol.Usage:
        """Seal and send every content chunk; return the usage from the final chunk."""
        usage: dict[str, Any] | None = None
        try:
            async for chunk in stream:
                if is_usage_chunk(chunk):
                    usage = chunk["usage"]
                    continue
                sealed = sealer.seal(json.dumps(chunk, separators=(",", ":")).encode())
                self._send(protocol.InferenceResponseChunk(request_id=job.request_id, encrypted_data=sealed), job)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # stops generation when we leave early (cancel, error)
        if usage is None:
            raise BackendError(502, "the backend finished without reporting token usage")
        return protocol.Usage(prompt_tokens=int(usage.get("prompt_tokens", 0)),
                              completion_tokens=int(usage.get("completion_tokens", 0)))

    async def _cancel_jobs(self) -> None:
        """The connection is gone: stop every request, usage reports included (nowhere to send them)."""
        jobs = list(self._jobs.values())
        tasks = [task for job in jobs for task in (job.task, job.settling) if task is not None]
        for job in jobs:
            job.cancelled = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in jobs:  # a task cancelled before it ever ran did not free its slot
            self._free(job)

    def _free(self, job: _Job) -> None:
        """The job is over: forget it and hand its slot back (once, however many paths get here)."""
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
            self.slots.release()

    def _set_state(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self.state, key, value)
        try:
            write_state(self.home, self.state)
        except OSError as exc:
            log.warning("cannot write %s: %s", paths.node_state_path(self.home), exc)
