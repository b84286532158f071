"""The provider node against a fake coordinator WebSocket endpoint, with the real llama.cpp backend."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import socket
import stat
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from darkbloom import paths
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.provider.backends import create_backend
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.config import load_config
from darkbloom.provider.node import ProviderNode
from darkbloom.provider.reconnect import ReconnectPolicy
from darkbloom.wire.runtime import runtime_hash
from tests.provider.fake_coordinator import Conn, FakeCoordinator
from tests.support.recording_backend import RecordingLlamaCppBackend

LONG_STORY = [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]


class Harness:
    def __init__(self, fake: FakeCoordinator, node: ProviderNode, backend: RecordingLlamaCppBackend,
                 home: Path) -> None:
        self.fake, self.node, self.backend, self.home = fake, node, backend, home
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def connect(self) -> tuple[Conn, protocol.Register]:
        conn = await self.fake.accept()
        register = await conn.recv()
        assert isinstance(register, protocol.Register), register
        return conn, register

    async def registered(self) -> Conn:
        conn, _ = await self.connect()
        await conn.send(protocol.Registered(provider_id="prov_test", account_id="acct_test", trust_level="self_signed"))
        return conn

    def state(self) -> dict[str, Any]:
        return json.loads(paths.node_state_path(self.home).read_text())

    async def wait_state(self, **expected: Any) -> dict[str, Any]:
        while True:  # bounded by the test timeout
            try:
                state = self.state()
            except (OSError, ValueError):
                state = {}
            if all(state.get(k) == v for k, v in expected.items()):
                return state
            await asyncio.sleep(0.02)


@pytest.fixture
async def harness(home: Path, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    max_concurrency = getattr(request, "param", 2)
    paths.auth_token_path(home).write_text("dkp-test-token\n")
    async with FakeCoordinator() as fake:
        config = load_config(home, {"coordinator_url": fake.url, "max_concurrency": max_concurrency})
        config.heartbeat_interval_secs = 0.2
        config.name = "test-node"
        config.context_length = 1024
        built = create_backend(config)
        assert isinstance(built, LlamaCppBackend) and built.max_concurrency == max_concurrency
        backend = RecordingLlamaCppBackend(built.models, max_concurrency=built.max_concurrency, n_ctx=built.n_ctx,
                                           n_threads=built.n_threads, extra_buffer_types=built.extra_buffer_types,
                                           gpu=built.gpu)
        node = ProviderNode(config, home, backend,
                            reconnect=ReconnectPolicy(base=0.05, restart_window=0.05, lost_window=0.05))
        h = Harness(fake, node, backend, home)
        h.task = asyncio.create_task(node.run(h.stop))
        try:
            yield h
        finally:
            h.stop.set()
            await asyncio.wait_for(h.task, 30)


def seal_request(node_public_key: str, body: dict[str, Any]) -> tuple[crypto.ReplyKey, protocol.Envelope]:
    reply_key = crypto.ReplyKey()
    envelope = reply_key.seal_request(json.dumps(body).encode(), crypto.public_key_from_b64(node_public_key))
    return reply_key, envelope


async def test_register_frame_describes_the_node(harness: Harness, gguf: Path) -> None:
    conn, register = await harness.connect()
    assert harness.fake.paths == ["/ws/provider"]
    identity_file = paths.identity_path(harness.home)
    assert stat.S_IMODE(identity_file.stat().st_mode) == 0o600
    identity = crypto.NodeIdentity.load_or_create(identity_file)
    assert register.auth_token == "dkp-test-token"
    assert register.public_key == identity.public_key_b64
    assert register.identity_key == identity.identity_key_b64
    assert register.runtime_hash == runtime_hash()
    assert register.encrypted_response_chunks is True
    assert (register.backend, register.max_concurrency, register.private_only, register.name) == \
        ("llama-cpp", 2, False, "test-node")
    assert register.version and register.hardware.cpu_count == os.cpu_count()
    assert (register.hardware.device, register.hardware.backend) == ("cpu", "llama-cpp")  # a CPU build here
    assert (harness.state()["device"], harness.state()["backend"]) == ("cpu", "llama-cpp")  # for `darkbloom status`
    [model] = register.models
    assert (model.id, model.size_bytes, model.quantization) == ("smollm2-135m", gguf.stat().st_size, "Q4_1")
    assert model.weight_hash.startswith("sha256:") and model.context_length == 1024
    blob = json.loads(base64.b64decode(register.attestation))
    assert crypto.verify_signature(register.identity_key, blob["body"].encode(), blob["signature"])
    body = json.loads(blob["body"])
    assert body["runtime_hash"] == runtime_hash() and body["encryption_key"] == register.public_key
    assert abs(body["timestamp"] - time.time()) < 120


async def test_challenge_before_registered_then_heartbeats(harness: Harness) -> None:
    conn, register = await harness.connect()
    nonce, timestamp = crypto.b64e(os.urandom(32)), int(time.time())
    await conn.send(protocol.AttestationChallenge(nonce=nonce, timestamp=timestamp))
    answer = await conn.recv_type(protocol.AttestationResponse)
    assert answer.nonce == nonce and answer.runtime_hash == runtime_hash()
    assert crypto.verify_signature(register.identity_key, crypto.challenge_message(nonce, timestamp, runtime_hash()),
                                   answer.signature)
    assert not crypto.verify_signature(register.identity_key,
                                       crypto.challenge_message(nonce, timestamp + 1, runtime_hash()), answer.signature)
    await conn.send(protocol.Registered(provider_id="prov_1", account_id="acct_1", trust_level="self_signed"))
    state = await harness.wait_state(connected=True, provider_id="prov_1")
    assert (state["account_id"], state["trust_level"], state["models"]) == ("acct_1", "self_signed", ["smollm2-135m"])
    assert state["pid"] == os.getpid() and state["local_url"] is None
    heartbeat = await conn.recv_type(protocol.Heartbeat)
    assert (heartbeat.status, heartbeat.active_requests, heartbeat.models) == ("idle", 0, ["smollm2-135m"])
    await conn.send(protocol.TrustStatus(trust_level="hardware"))
    await harness.wait_state(trust_level="hardware")


async def test_sealed_request_is_answered_with_sealed_chunks(harness: Harness) -> None:
    conn = await harness.registered()
    register = conn.frames[0]
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    reply_key, envelope = seal_request(register.public_key, body)
    await conn.send(protocol.InferenceRequest(request_id="req_1", encrypted_body=envelope))
    assert (await conn.recv_type(protocol.InferenceAccepted)).request_id == "req_1"
    chunks, keys = [], set()
    while True:
        frame = await conn.recv_type((protocol.InferenceResponseChunk, protocol.InferenceComplete))
        assert frame.request_id == "req_1"
        if isinstance(frame, protocol.InferenceComplete):
            break
        keys.add(frame.encrypted_data.ephemeral_public_key)
        assert b"chat.completion" not in base64.b64decode(frame.encrypted_data.ciphertext)
        chunks.extend(response_chunks(reply_key.open(frame.encrypted_data)))
    assert len(keys) == 1 and envelope.ephemeral_public_key not in keys  # one sealer per request
    assert all(chunk["choices"] and "usage" not in chunk for chunk in chunks)  # usage is not a content chunk
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip()
    assert frame.usage.prompt_tokens > 5 and 0 < frame.usage.completion_tokens <= 8
    assert harness.backend.recent[-1].completion_tokens == frame.usage.completion_tokens


async def test_cancel_stops_generation_and_reports_the_tokens_used(harness: Harness) -> None:
    conn = await harness.registered()
    body = {"model": "smollm2-135m", "messages": LONG_STORY, "max_tokens": 400, "temperature": 0}
    reply_key, envelope = seal_request(conn.frames[0].public_key, body)
    await conn.send(protocol.InferenceRequest(request_id="req_long", encrypted_body=envelope))
    await conn.recv_type(protocol.InferenceAccepted)
    await conn.recv_chunks(reply_key, 3)  # the role chunk, then at least two sampled tokens
    await conn.send(protocol.Cancel(request_id="req_long"))
    # Barrier: the node handles the coordinator's frames in order and its own frames leave in order,
    # so once the challenge answer arrives the cancel was handled: no chunk may follow it.
    await conn.send(protocol.AttestationChallenge(nonce=crypto.b64e(os.urandom(32)), timestamp=int(time.time())))
    after_barrier, report = False, None
    while not (after_barrier and report is not None):
        frame = await conn.recv()
        if isinstance(frame, protocol.AttestationResponse):
            after_barrier = True
        elif isinstance(frame, protocol.InferenceComplete):
            assert frame.request_id == "req_long" and report is None
            report = frame
        elif not isinstance(frame, protocol.Heartbeat):
            assert isinstance(frame, protocol.InferenceResponseChunk) and not after_barrier and report is None, frame
    # The report waited for the worker to stop: it counts exactly what was generated.
    [record] = harness.backend.recent
    assert record.cancelled
    assert report.usage.prompt_tokens == record.prompt_tokens > 5
    assert 2 <= report.usage.completion_tokens == record.completion_tokens < 400
    assert "req_long" not in harness.node.fleet.jobs
    # The freed slot serves the next request; nothing else was ever sent for the cancelled one.
    report_at = conn.frames.index(report)
    _, envelope = seal_request(conn.frames[0].public_key, {**body, "max_tokens": 3})
    await conn.send(protocol.InferenceRequest(request_id="req_next", encrypted_body=envelope))
    while not isinstance(done := await conn.recv(), protocol.InferenceComplete):
        pass
    assert done.request_id == "req_next"
    await conn.send(protocol.Cancel(request_id="req_long"))  # a late duplicate cancel is ignored
    await conn.send(protocol.Cancel(request_id="req_next"))  # so is a cancel after completion
    # A request served after them is the barrier: a wrong report, sent as a cancelled request's is
    # (a few loop turns after the cancel), would come before this generation has completed.
    _, envelope = seal_request(conn.frames[0].public_key, {**body, "max_tokens": 2})
    await conn.send(protocol.InferenceRequest(request_id="req_last", encrypted_body=envelope))
    while not isinstance(done := await conn.recv(), protocol.InferenceComplete):
        pass
    assert all(getattr(f, "request_id", None) != "req_long" for f in conn.frames[report_at + 1:])
    completes = [f.request_id for f in conn.frames if isinstance(f, protocol.InferenceComplete)]
    assert completes == ["req_long", "req_next", "req_last"]


@pytest.mark.parametrize("harness", [1], indirect=True)
async def test_request_errors(harness: Harness) -> None:
    conn = await harness.registered()
    public_key = conn.frames[0].public_key
    # sealed to some other key: it does not open
    wrong = crypto.ReplyKey().seal_request(b"{}", crypto.NodeIdentity.generate().encryption_key.public_key)
    await conn.send(protocol.InferenceRequest(request_id="req_wrong_key", encrypted_body=wrong))
    error = await conn.recv_type(protocol.InferenceError)
    assert (error.request_id, error.status_code) == ("req_wrong_key", 400)
    _, envelope = seal_request(public_key, {"model": "other", "messages": [{"role": "user", "content": "x"}]})
    await conn.send(protocol.InferenceRequest(request_id="req_model", encrypted_body=envelope))
    error = await conn.recv_type(protocol.InferenceError)
    assert (error.request_id, error.status_code) == ("req_model", 404)
    _, envelope = seal_request(public_key, {"model": "smollm2-135m", "messages": "nope"})
    await conn.send(protocol.InferenceRequest(request_id="req_bad", encrypted_body=envelope))
    await conn.recv_type(protocol.InferenceAccepted)
    error = await conn.recv_type(protocol.InferenceError)
    assert (error.request_id, error.status_code) == ("req_bad", 400) and "messages" in error.message
    # llama.cpp's own error text is not passed on (inference_error is not sealed): our sentence, no prompt
    _, envelope = seal_request(public_key, {"model": "smollm2-135m", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "lighthouse " * 1500}]})
    await conn.send(protocol.InferenceRequest(request_id="req_too_long", encrypted_body=envelope))
    await conn.recv_type(protocol.InferenceAccepted)
    error = await conn.recv_type(protocol.InferenceError)
    assert (error.request_id, error.status_code) == ("req_too_long", 400)
    assert "context window of 1024" in error.message and "lighthouse" not in error.message
    # max_concurrency 1: a second request while one runs is refused with 429
    _, long_body = seal_request(public_key, {"model": "smollm2-135m", "messages": LONG_STORY, "max_tokens": 400})
    await conn.send(protocol.InferenceRequest(request_id="req_busy", encrypted_body=long_body))
    await conn.recv_type(protocol.InferenceAccepted)
    await conn.send(protocol.InferenceRequest(request_id="req_extra", encrypted_body=long_body))
    while not isinstance(frame := await conn.recv(), protocol.InferenceError):
        assert getattr(frame, "request_id", "req_busy") == "req_busy"
    assert (frame.request_id, frame.status_code) == ("req_extra", 429)
    while not isinstance(heartbeat := await conn.recv(), protocol.Heartbeat):
        pass
    assert (heartbeat.status, heartbeat.active_requests) == ("busy", 1)
    await conn.send(protocol.Cancel(request_id="req_busy"))
    # malformed and unknown frames from the coordinator are ignored, the session goes on
    await conn.send({"type": "surprise"})
    await conn.ws.send("not json")
    nonce = crypto.b64e(os.urandom(32))
    await conn.send(protocol.AttestationChallenge(nonce=nonce, timestamp=1))
    while not isinstance(frame := await conn.recv(), protocol.AttestationResponse):
        pass
    assert frame.nonce == nonce


async def test_reconnects_after_the_coordinator_drops_it(harness: Harness) -> None:
    first = await harness.registered()
    await harness.wait_state(connected=True, provider_id="prov_test")
    await first.ws.close()
    second, register = await harness.connect()
    assert register.identity_key == first.frames[0].identity_key  # same identity on every connection
    assert register.auth_token == "dkp-test-token"
    await second.send(protocol.Registered(provider_id="prov_again", trust_level="self_signed"))
    await harness.wait_state(connected=True, provider_id="prov_again")
    # a request on the new connection is served
    _, envelope = seal_request(register.public_key, {"model": "smollm2-135m", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    await second.send(protocol.InferenceRequest(request_id="req_after", encrypted_body=envelope))
    complete = await second.recv_type((protocol.InferenceAccepted, protocol.InferenceResponseChunk,
                                       protocol.InferenceComplete))
    while not isinstance(complete, protocol.InferenceComplete):
        complete = await second.recv()
    assert complete.request_id == "req_after"


async def test_stop_mid_request_ends_cleanly(harness: Harness) -> None:
    conn = await harness.registered()
    _, envelope = seal_request(conn.frames[0].public_key, {"model": "smollm2-135m", "messages": LONG_STORY,
                                                           "max_tokens": 400})
    await conn.send(protocol.InferenceRequest(request_id="req_stop", encrypted_body=envelope))
    await conn.recv_type(protocol.InferenceAccepted)
    await conn.recv_type(protocol.InferenceResponseChunk)
    harness.stop.set()
    assert harness.task is not None
    await asyncio.wait_for(harness.task, 30)
    assert harness.state()["connected"] is False
    assert harness.backend.recent and harness.backend.recent[-1].cancelled


class _Ceilings(random.Random):
    """Full jitter with no wait: records each delay's upper bound."""

    def __init__(self) -> None:
        super().__init__(0)
        self.ceilings: list[float] = []

    def uniform(self, low: float, high: float) -> float:
        assert low == 0  # full jitter: anywhere in [0, bound]
        self.ceilings.append(high)
        return 0.0


async def test_backoff_doubles_to_30_s_and_resets_after_registration(home: Path) -> None:
    rng = _Ceilings()
    ceilings = rng.ceilings
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = load_config(home, {"coordinator_url": closed_url})
    node = ProviderNode(config, home, reconnect=ReconnectPolicy(rng=rng))
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    try:
        while len(ceilings) < 7:
            await asyncio.sleep(0.01)
        assert ceilings[:7] == [1, 2, 4, 8, 16, 30, 30]
        async with FakeCoordinator() as fake:
            config.coordinator_url = fake.url  # the next attempt reaches a coordinator
            conn = await fake.accept()
            await conn.recv_type(protocol.Register)
            await conn.send(protocol.Registered(provider_id="prov_1"))
            while json.loads(paths.node_state_path(home).read_text()).get("provider_id") != "prov_1":
                await asyncio.sleep(0.01)
            attempts = len(ceilings)
            await conn.ws.close()
            while len(ceilings) == attempts:
                await asyncio.sleep(0.01)
            assert ceilings[attempts] == 1  # a lost session (1000): back within 1 s, the backoff reset
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
