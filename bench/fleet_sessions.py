"""Simulated provider sessions for bench/fleet_scale.py: many per process, on one asyncio loop.

Each session is a real WebSocket connection speaking the real protocol (darkbloom.wire): it sends
`register` with its identity keys and a fresh signed attestation, answers every attestation challenge (the
first is part of registration), heartbeats like a node (every ``heartbeat_interval_secs``, from a
random phase), pings as a node does (``reconnect.KEEPALIVE``), and when the connection is lost
reconnects with the node's own policy
(``darkbloom.provider.reconnect.ReconnectPolicy``: a restart spread over a window, refusals backed
off exponentially with full jitter, reset by a registration). A few sessions answer inference requests with one short fixed chunk; the others
advertise a model nobody asks for.

A worker process (``worker_main``) runs its share of the fleet and obeys commands from the bench over
a pipe: ``start`` (the first connections, at most ``inflight`` registering at once and at most
``rate`` started per second), ``status``, ``mark`` (time every session's next registration from now),
``drop`` (abort every socket; the sessions reconnect by the policy) and ``stop``.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from darkbloom.provider.config import ProviderConfig
from darkbloom.provider.reconnect import KEEPALIVE, TRY_AGAIN_LATER, ReconnectPolicy
from darkbloom.wire.crypto import NodeIdentity, Sealer, challenge_message
from darkbloom.wire.protocol import (
    MAX_REQUEST_FRAME_BYTES,
    AttestationChallenge,
    AttestationResponse,
    ErrorFrame,
    Heartbeat,
    InferenceComplete,
    InferenceRequest,
    InferenceResponseChunk,
    ModelInfo,
    Register,
    Registered,
    TrustStatus,
    Usage,
    dump,
    parse_coordinator_frame,
)
from darkbloom.wire.runtime import runtime_hash

OPEN_TIMEOUT = 15.0  # the node's `connect(open_timeout=…)`
REGISTER_TIMEOUT = 90.0  # a node waits for ever; a session here gives up and counts it
HEARTBEAT_EVERY = ProviderConfig.heartbeat_interval_secs  # a node's default


@dataclass(frozen=True)
class SessionSpec:
    url: str  # ws://…/ws/provider of the replica this session dials
    replica: int
    token: str  # a `dkp-` device token of a seeded machine
    model: str
    answering: bool
    max_concurrency: int = 1


@dataclass
class Tally:
    """What a worker saw since the last ``status``-reset: attempts and how each ended."""

    attempts: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    drops: int = 0  # registered connections that were lost
    untrusted: int = 0  # trust_status frames that said so
    errors: int = 0  # error frames
    served: int = 0
    latencies: list[float] = field(default_factory=list)  # connect → `registered`, per attempt that made it


class Session:
    def __init__(self, spec: SessionSpec, worker: Worker) -> None:
        self.spec = spec
        self.worker = worker
        self.ws: ClientConnection | None = None
        self.identity = NodeIdentity.generate()  # kept across reconnections, as a node keeps its own
        self.registered = False
        self.marked_at: float | None = None  # monotonic time of the first registration after `mark`
        self.runtime = worker.runtime

    async def run(self, first: asyncio.Semaphore | None) -> None:
        policy = ReconnectPolicy()
        while True:
            if first is not None:
                async with first:
                    registered, close_code = await self._connect_once(serve=False)
                first = None
                if registered:
                    registered, close_code = await self._serve()
            else:
                registered, close_code = await self._connect_once(serve=True)
            await asyncio.sleep(policy.delay(registered, close_code))

    async def _connect_once(self, serve: bool) -> tuple[bool, int | None]:
        """One connection up to `registered` (and, with ``serve``, served until it closes): whether it
        registered, and the code the connection was closed with (None: no connection). Failures are
        counted by kind."""
        tally = self.worker.tally
        tally.attempts += 1
        started = time.monotonic()
        try:
            self.ws = await connect(self.spec.url, max_size=MAX_REQUEST_FRAME_BYTES, compression=None,
                                    open_timeout=OPEN_TIMEOUT, close_timeout=2, proxy=None, **KEEPALIVE)
        except TimeoutError:
            tally.failures["connect timeout"] += 1
            return False, None
        except ConnectionRefusedError:
            tally.failures["connection refused"] += 1
            return False, None
        except (InvalidStatus, InvalidHandshake):
            tally.failures["broken handshake"] += 1
            return False, None
        except OSError as exc:
            tally.failures[f"connect error ({type(exc).__name__})"] += 1
            return False, None
        try:
            async with asyncio.timeout(REGISTER_TIMEOUT):
                await self._register()
        except TimeoutError:
            tally.failures["no `registered` in time"] += 1
            self._abort()
            return False, None
        except ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd is not None else None
            tally.failures["try again later (1013)" if code == TRY_AGAIN_LATER else "closed before `registered`"] += 1
            self._abort()
            return False, code
        except OSError:
            tally.failures["closed before `registered`"] += 1
            self._abort()
            return False, None
        tally.latencies.append(time.monotonic() - started)
        self.registered = True
        self.worker.registered[self.spec.replica] += 1
        if self.worker.mark is not None and self.marked_at is None:
            self.marked_at = time.monotonic()
        return await self._serve() if serve else (True, None)

    async def _register(self) -> None:
        assert self.ws is not None
        identity = self.identity
        await self.ws.send(dump(Register(
            auth_token=self.spec.token, models=[ModelInfo(id=self.spec.model)], backend="fleet-bench",
            version="bench", runtime_hash=self.runtime, public_key=identity.public_key_b64,
            identity_key=identity.identity_key_b64, attestation=identity.attestation(self.runtime),
            max_concurrency=self.spec.max_concurrency, authenticated_chunks=True,
            max_request_frame_bytes=MAX_REQUEST_FRAME_BYTES)))
        while not isinstance(await self._handle(await self.ws.recv()), Registered):
            pass

    async def _serve(self) -> tuple[bool, int | None]:
        """Heartbeat and answer until the connection closes: True (it had registered) and the code
        it was closed with (1006: no close frame)."""
        assert self.ws is not None
        beats = asyncio.create_task(self._heartbeats(self.ws))
        try:
            async for raw in self.ws:
                await self._handle(raw)
        except (ConnectionClosed, OSError):
            pass
        finally:
            beats.cancel()
            self.registered = False
            self.worker.registered[self.spec.replica] -= 1
            self.worker.tally.drops += 1
        return True, self.ws.close_code

    async def _handle(self, raw: str | bytes) -> Any:
        assert self.ws is not None
        frame = parse_coordinator_frame(raw)
        if isinstance(frame, AttestationChallenge):
            message = challenge_message(frame.nonce, frame.timestamp, self.runtime)
            await self.ws.send(dump(AttestationResponse(nonce=frame.nonce, signature=self.identity.sign(message),
                                                        runtime_hash=self.runtime)))
        elif isinstance(frame, InferenceRequest):
            await self._answer(frame)
        elif isinstance(frame, TrustStatus) and frame.trust_level == "untrusted":
            self.worker.tally.untrusted += 1
        elif isinstance(frame, ErrorFrame):
            self.worker.tally.errors += 1
        return frame

    async def _answer(self, request: InferenceRequest) -> None:
        """One sealed chunk from the node's own key, then the usage: the short fixed answer."""
        assert self.ws is not None
        sealer = Sealer.between(self.identity.encryption_key, request.encrypted_body.ephemeral_public_key)
        await self.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                       encrypted_data=sealer.seal(ANSWER))))
        await self.ws.send(dump(InferenceComplete(request_id=request.request_id,
                                                  usage=Usage(prompt_tokens=3, completion_tokens=2))))
        self.worker.tally.served += 1

    async def _heartbeats(self, ws: ClientConnection) -> None:
        frame = self.worker.heartbeat_frames[self.spec.model]
        await asyncio.sleep(random.uniform(0, HEARTBEAT_EVERY))
        while True:
            await ws.send(frame)
            await asyncio.sleep(HEARTBEAT_EVERY)

    def _abort(self) -> None:
        if self.ws is not None and self.ws.transport is not None:
            self.ws.transport.abort()


ANSWER = json.dumps({"id": "fleet", "object": "chat.completion.chunk", "created": 0, "model": "fleet",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                  "finish_reason": "stop"}]}).encode()


class Worker:
    def __init__(self, specs: list[SessionSpec], replicas: int) -> None:
        self.runtime = runtime_hash()
        self.sessions = [Session(spec, self) for spec in specs]
        self.registered = [0] * replicas
        self.tally = Tally()
        self.mark: float | None = None
        self.heartbeat_frames = {s.model: dump(Heartbeat(models=[s.model])) for s in specs}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, inflight: int, rate: float) -> None:
        first = asyncio.Semaphore(max(1, inflight))
        loop = asyncio.get_running_loop()
        for n, session in enumerate(self.sessions):
            delay = n / rate if rate > 0 else 0.0
            self.tasks.append(loop.create_task(self._later(delay, session.run(first))))

    @staticmethod
    async def _later(delay: float, work: Any) -> None:
        if delay:
            await asyncio.sleep(delay)
        await work

    def status(self, reset: bool) -> dict[str, Any]:
        tally = self.tally
        since_mark = [s.marked_at - self.mark for s in self.sessions
                      if self.mark is not None and s.marked_at is not None]
        report = {"sessions": len(self.sessions), "registered": list(self.registered), "attempts": tally.attempts,
                  "failures": dict(tally.failures), "drops": tally.drops, "untrusted": tally.untrusted,
                  "errors": tally.errors, "served": tally.served, "latencies": list(tally.latencies),
                  "since_mark": since_mark}
        if reset:
            self.tally = Tally()
        return report

    def set_mark(self, at: float) -> None:
        self.mark = at
        for session in self.sessions:
            session.marked_at = None

    def drop(self) -> None:
        for session in self.sessions:
            if session.registered:
                session._abort()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for session in self.sessions:
            session._abort()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the bench that started it dies (even by SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


async def _serve_commands(conn: Connection, worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: commands.put_nowait(conn.recv()))
    while True:
        command, *args = await commands.get()
        if command == "start":
            worker.start(*args)
            conn.send("started")
        elif command == "status":
            conn.send(worker.status(*args))
        elif command == "mark":
            worker.set_mark(*args)
            conn.send("marked")
        elif command == "drop":
            worker.drop()
            conn.send("dropped")
        elif command == "stop":
            loop.remove_reader(conn.fileno())
            await worker.stop()
            conn.send("stopped")
            return


def worker_main(conn: Connection, specs: list[SessionSpec], replicas: int) -> None:
    """A client process: its sessions on one uvloop loop, until ``stop``."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle: it sends `stop`
    import uvloop

    uvloop.run(_serve_commands(conn, Worker(specs, replicas)))
