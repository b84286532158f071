"""No prompt or completion byte crosses NATS between coordinator replicas (issue 14's capture test).

Two real replicas of one coordinator (Postgres, Redis, the machine's NATS under the run's own subject
prefix): replica A holds the only node — a real `darkbloom serve`, linked to ``owner``, on the
`openai` backend in front of an upstream started here that answers with the request's canary (so
the completion carries it, and a completion-only secret derived from it) — and every consumer
request goes to replica B, so each one crosses the NATS hop: plain, streamed, exclusive self-route
(`X-Darkbloom-Route: self`), prefer, a sealed body (non-streamed on the fleet, streamed under
`self`), and errors after dispatch (the upstream refuses `top_k: -1` quoting the prompt, streamed and
not; the upstream fails in the middle of its answer, streamed and not).

Recorded two ways, independently:
- tshark on loopback port 4222 from before the replicas connect: every NATS connection reassembled
  and parsed here (CONNECT/INFO/PUB/MSG/…), the raw pcap file itself searched as well;
- a nats-py subscriber to ``<prefix>.>`` (every announcement, claim, hold and back message of the
  run) and to ``_INBOX.>`` (kept: the answers to the run's claims).

What is searched (tests/reliability/test_capture.py's needles): each request's canary as text,
lower-cased, hex and base64 in all alignments (both alphabets), its random part alone likewise, the
completion-only secret likewise, and every 12-character window of the completion the client got with
at least six distinct characters (as text and JSON-escaped).

Positive controls, so that a capture that saw nothing cannot pass: every request's id is in a hold
message to A whose frame is byte for byte the `inference_request` A then wrote to the node's
WebSocket (tshark on A's port), every sealed chunk the node sent for it went back to B on its
attempt's subject with the same ciphertext, the node's refusals went back as error messages, the
subscriber's messages are the ones on the wire, and the consumer's own plaintext HTTP connection
to B (tshark on B's port) does show the plain request's canary and completion.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx
import nats
import pytest

import tests.reliability.test_capture as ws_capture
from tests.support.billing import node_home, wait_registered
from tests.support.accounts import Account, create_account, device_token, wait_model_listed, wait_online
from tests.support.capture import (CaptureUnavailable, Connection, NatsDecode, NatsMessage, Tshark, WsMessage,
                                   find_any, nats_messages, read_connections, secret_forms,
                                   websocket_messages)
from tests.support.databases import postgres_database
from tests.support.processes import Coordinator, Process, darkbloom_cmd, free_port, spawn, wait_until
from tests.support.replicas import NATS_URL, Replicas

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(300)]

MODEL = ws_capture.MODEL
NATS_PORT = 4222
FAIL_MIDWAY = "FAIL-MIDWAY"  # in a prompt: the upstream breaks off its answer half-way
KINDS = ["plain", "stream", "self", "prefer", "sealed", "sealed_self_stream", "error_param", "error_param_stream",
         "error_midway", "error_midway_stream"]
SERVED = ["plain", "stream", "self", "prefer", "sealed", "sealed_self_stream"]

# An OpenAI-compatible upstream that repeats the request's canary (the node always streams from it).
ECHO_UPSTREAM = r'''
import asyncio, hashlib, json, re, sys, time
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

def chunk(model, delta, finish=None, usage=None):
    data = {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        data["usage"] = usage
    return b"data: " + json.dumps(data).encode() + b"\n\n"

async def chat(request):
    body = await request.json()
    model = body.get("model", "echo")
    prompt = " ".join(m["content"] for m in body.get("messages", []) if isinstance(m.get("content"), str))
    if body.get("top_k") == -1:  # a refusal that quotes the prompt, as real servers' do
        return JSONResponse({"error": {"message": f"top_k must be >= 0 (got -1) for prompt {prompt!r}",
                                       "type": "invalid_request_error", "param": "top_k", "code": "invalid_value"}},
                            status_code=400)
    found = re.search(r"Canary[0-9a-f]{16}", prompt)
    canary = found.group(0) if found else "nothing"
    secret = "Reply" + hashlib.sha256(canary.encode()).hexdigest()[:16]
    words = ["Here", " is", " your", " code:", " " + canary, ",", " again", " " + canary, "; and", " mine:",
             " " + secret, " (" + canary + ")", "."]
    midway = "FAIL-MIDWAY" in prompt

    async def events():
        yield chunk(model, {"role": "assistant", "content": ""})
        for index, word in enumerate(words):
            if midway and index == 6:
                raise RuntimeError("the upstream broke off")  # the connection ends mid-answer
            await asyncio.sleep(0.005)
            yield chunk(model, {"content": word})
        yield chunk(model, {}, "stop")
        yield chunk(model, {}, usage={"prompt_tokens": 12, "completion_tokens": len(words),
                                      "total_tokens": 12 + len(words)})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
'''


def completion_secret(canary: str) -> str:
    return "Reply" + hashlib.sha256(canary.encode()).hexdigest()[:16]


def needles(sent: ws_capture.Sent) -> dict[str, bytes]:
    found = sent.needles()
    found.update({f"completion secret {name}": form for name, form in secret_forms(completion_secret(sent.canary)).items()})
    return found


@dataclass
class Recorded:
    subject: str
    reply: str
    data: bytes
    headers: dict[str, str]


class Recorder:
    """A nats-py client on its own thread subscribed to ``<prefix>.>`` and ``_INBOX.>``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.name = f"capture-recorder {prefix}"
        self.messages: list[Recorded] = []
        self.inbox: list[Recorded] = []
        self._loop = asyncio.new_event_loop()
        self._nc: Any = None
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(20)

    async def _start(self) -> None:
        self._nc = await nats.connect(NATS_URL, name=self.name)

        def into(box: list[Recorded]) -> Any:
            async def record(msg: Any) -> None:
                box.append(Recorded(msg.subject, msg.reply or "", bytes(msg.data), dict(msg.headers or {})))
            return record
        await self._nc.subscribe(self.prefix + ".>", cb=into(self.messages))
        await self._nc.subscribe("_INBOX.>", cb=into(self.inbox))
        await self._nc.flush()

    def publish(self, subject: str, data: bytes) -> None:
        async def send() -> None:
            await self._nc.publish(subject, data)
            await self._nc.flush()
        asyncio.run_coroutine_threadsafe(send(), self._loop).result(20)

    def close(self) -> None:
        async def shut() -> None:
            await self._nc.flush()
            await asyncio.sleep(0.3)
            await self._nc.drain()
        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(20)
        self._loop.call_soon_threadsafe(self._loop.stop)


@dataclass
class Port:
    """One capture of one port, read after the run."""

    capture: Tshark
    port: int
    connections: list[Connection] = field(default_factory=list)

    def read(self) -> None:
        self.connections = read_connections(self.capture.pcap, self.port)


@dataclass(repr=False)
class Run:
    prefix: str
    a: Coordinator
    b: Coordinator
    node_session: str
    sent: dict[str, ws_capture.Sent]
    nats: Port
    holder_port: Port
    consumer_port: Port
    recorder: Recorder
    decoded: dict[int, NatsDecode]       # every NATS connection of the capture, by tcp stream
    replica_streams: dict[str, int]     # replica name (CONNECT name) -> tcp stream
    ws: list[WsMessage]
    ws_problems: list[str]
    pcap_bytes: bytes
    planted: ws_capture.Sent  # a canary the test itself published in the clear on NATS (the search's control)
    node_log: Path

    def __repr__(self) -> str:
        return f"Run({len(self.decoded)} NATS connections, {len(self.recorder.messages)} recorded messages)"

    def replica_messages(self) -> list[NatsMessage]:
        """What the two replicas published (their PUBs), in order per connection."""
        return [m for stream in self.replica_streams.values() for m in self.decoded[stream].messages if m.from_client]

    def consumer(self, kind: str) -> list[Connection]:
        return [c for c in self.consumer_port.connections if c.header(ws_capture.TAG) == kind]


def port_of(coord: Coordinator) -> int:
    port = urlsplit(coord.base_url).port
    assert port is not None
    return port


def _send_all(b: Coordinator, owner: Account, consumer: Account) -> dict[str, ws_capture.Sent]:
    sent = {kind: ws_capture.Sent(kind, "Canary" + secrets.token_hex(8)) for kind in KINDS}
    ws_capture._plain(b, consumer, sent["plain"])
    ws_capture._streamed(b, consumer, sent["stream"])
    ws_capture._plain(b, owner, sent["self"], {"X-Darkbloom-Route": "self"})
    ws_capture._streamed(b, owner, sent["prefer"], {"X-Darkbloom-Route": "prefer"})
    ws_capture._sealed(b, consumer, sent["sealed"], stream=False)
    ws_capture._sealed(b, owner, sent["sealed_self_stream"], stream=True, headers={"X-Darkbloom-Route": "self"})
    body = ws_capture._body
    ws_capture._failing(b, consumer, sent["error_param"], body(sent["error_param"], top_k=-1))
    ws_capture._failing(b, consumer, sent["error_param_stream"], body(sent["error_param_stream"], top_k=-1, stream=True))
    for kind, stream in (("error_midway", False), ("error_midway_stream", True)):
        s = sent[kind]
        request = {**body(s, **({"stream": True} if stream else {})),
                   "messages": [{"role": "user", "content": f"{ws_capture._prompt(s.canary)} {FAIL_MIDWAY}"}]}
        ws_capture._failing(b, consumer, s, request)
        if stream:  # what reached the client before the error event is a completion too
            s.completion = ws_capture._completion_of(
                [json.loads(e) for e in ws_capture._events(s.error) if e.startswith("{")])
    return sent


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("capture-nats")
    planted = ws_capture.Sent("planted", "Canary" + secrets.token_hex(8))
    try:
        nats_capture = Port(Tshark(NATS_PORT, root / "nats.pcap"), NATS_PORT)
    except CaptureUnavailable as exc:
        pytest.skip(f"no packet capture here: {exc}")
    captures = [nats_capture]
    processes: list[Process] = []
    recorder: Recorder | None = None
    try:
        with postgres_database() as url:
            replicas = Replicas(root / "replicas", url)
            recorder = Recorder(replicas.prefix)  # subscribed before the first replica says anything
            try:
                a, b = replicas.start(name="holder"), replicas.start(name="admitter")
                replicas.wait_joined()
                holder_port = Port(Tshark(port_of(a), root / "holder.pcap"), port_of(a))
                captures.append(holder_port)
                consumer_port = Port(Tshark(port_of(b), root / "admitter.pcap"), port_of(b))
                captures.append(consumer_port)

                upstream_port = free_port()
                upstream = spawn([sys.executable, "-c", ECHO_UPSTREAM, str(upstream_port)], root / "upstream",
                                 "upstream.log")
                processes.append(upstream)
                wait_until(lambda: _up(f"http://127.0.0.1:{upstream_port}", upstream), timeout=30, what="echo upstream")
                owner = create_account(b, credit_micro_usd=10_000_000)
                consumer = create_account(b, credit_micro_usd=10_000_000)
                token = device_token(b, owner)
                node = spawn(darkbloom_cmd("serve", "--coordinator", a.base_url, "--backend", "openai",
                                           "--upstream-url", f"http://127.0.0.1:{upstream_port}", "--model", MODEL,
                                           "--max-concurrency", "2"), node_home(root, "node", token), "node.log")
                processes.append(node)
                node_session = wait_registered(node)
                wait_online(b, owner)  # the node, seen through B
                wait_model_listed(b, consumer)
                sent = _send_all(b, owner, consumer)
                # a control for the search: a canary published in the clear (base64 at an odd offset,
                # inside JSON) on the run's prefix, where no replica listens
                planted.completion = f"planted text {planted.canary} ends here"
                recorder.publish(f"{replicas.prefix}.probe", json.dumps({
                    "b64": base64.b64encode(b"\x01" + planted.canary.encode()).decode(),
                    "text": planted.completion}).encode())
                time.sleep(0.5)  # the last release and announcement after the final request
            finally:
                for process in reversed(processes):
                    process.stop()
                replicas.close()
                recorder.close()
    finally:
        for capture in captures:
            capture.capture.stop()
    for capture in captures:
        capture.read()
    decoded = {c.stream: nats_messages(c) for c in nats_capture.connections}
    replica_streams = {}
    for stream, d in decoded.items():
        name = str(d.connect_options().get("name", ""))
        if name.startswith("darkbloom coordinator") and any(s.startswith(replicas.prefix + ".")
                                                             for s in d.subscriptions()):
            replica_streams[name] = stream
    ws: list[WsMessage] = []
    ws_problems: list[str] = []
    for connection in holder_port.connections:
        if connection.is_provider_socket():
            result = websocket_messages(connection)
            ws += result.messages
            ws_problems += result.problems
    yield Run(replicas.prefix, a, b, node_session, sent, nats_capture, holder_port, consumer_port, recorder, decoded,
              replica_streams, ws, ws_problems, nats_capture.capture.pcap.read_bytes(), planted,
              node.log_path)


def _up(url: str, process: Process) -> bool:
    if process.proc.poll() is not None:
        raise AssertionError(f"echo upstream exited:\n{process.log()}")
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def _leaks(run: Run, haystacks: dict[str, bytes], kinds: list[str] | None = None) -> list[str]:
    report = []
    for kind in kinds or list(run.sent):
        sent = run.planted if kind == "planted" else run.sent[kind]
        for where, haystack in haystacks.items():
            for name, needle, at in find_any(haystack, needles(sent)):
                report.append(f"{kind}: {name} = {needle!r} in {where} at byte {at}: "
                              f"…{haystack[max(0, at - 80):at + 80]!r}…")
    return report


def _body(data: bytes) -> bytes:
    """A fabric message after its proof line (docs/replicas.md, "Authentication")."""
    proof, _, body = data.partition(b"\n")
    assert proof.startswith(b"DBA1 "), proof[:80]
    return body


def _holds(run: Run) -> list[tuple[dict[str, Any], bytes]]:
    """The messages to the holder (header, frame): what B published on ``<prefix>.hold.<A>``."""
    found = []
    for message in run.replica_messages():
        if message.subject.startswith(run.prefix + ".hold."):
            header, _, payload = _body(message.payload).partition(b"\n")
            found.append((json.loads(header), payload))
    return found


def _request_frames(run: Run) -> dict[str, tuple[str, bytes]]:
    """request id -> (ticket, the whole inference_request frame), from the hold messages (parts joined)."""
    parts: dict[str, dict[int, bytes]] = defaultdict(dict)
    heads: dict[str, dict[str, Any]] = {}
    for header, payload in _holds(run):
        if header.get("k") == "request":
            parts[header["t"]][int(header.get("p", 0))] = payload
            heads[header["t"]] = header
    frames = {}
    for ticket, header in heads.items():
        count = int(header.get("n", 1))
        if len(parts[ticket]) == count:
            frames[header["r"]] = (ticket, b"".join(parts[ticket][i] for i in range(count)))
    return frames


def _backs(run: Run) -> dict[str, list[dict[str, Any]]]:
    """ticket -> the items A sent back on ``<prefix>.back.<B>.<ticket>``, in order (each message
    carries the frames of one loop turn, a JSON array)."""
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for message in run.replica_messages():
        if message.subject.startswith(run.prefix + ".back."):
            found[message.subject.rsplit(".", 1)[1]].extend(json.loads(_body(message.payload)))
    return found


def _ws_frames(run: Run, from_node: bool) -> list[tuple[bytes, dict[str, Any]]]:
    return [(m.payload, json.loads(m.payload)) for m in run.ws if m.opcode in (1, 2) and m.from_client == from_node]


def test_the_capture_saw_every_request_cross_the_nats_hop(run: Run) -> None:
    """Guards the leak tests: both replicas' NATS connections were captured from their start and
    decode cleanly, and every request travelled over them — its frame exactly what the node then got,
    its sealed chunks exactly what the node sent."""
    for capture in (run.nats, run.holder_port, run.consumer_port):
        assert capture.capture.dropped() is None, f"tshark dropped packets: {capture.capture.dropped()}"
    assert len(run.replica_streams) == 2, f"replica NATS connections found: {sorted(run.replica_streams)}"
    for name, stream in run.replica_streams.items():
        decoded = run.decoded[stream]
        assert not decoded.problems, (name, decoded.problems)
        assert decoded.messages, name
    assert not run.ws_problems, run.ws_problems
    subjects = Counter(m.subject.split(".")[1] for m in run.replica_messages() if m.subject.startswith(run.prefix))
    assert subjects["fleet"] and subjects["claim"] and subjects["hold"] and subjects["back"], subjects

    frames = _request_frames(run)
    ws_requests = {frame["request_id"]: text for text, frame in _ws_frames(run, from_node=False)
                   if frame.get("type") == "inference_request"}
    for kind in SERVED:
        sent = run.sent[kind]
        assert sent.request_id in frames, f"{kind} ({sent.request_id}) never crossed NATS to the holder"
        assert sent.completion.strip(), f"{kind}: empty completion"
    # every request the holder got over NATS is byte for byte the frame the node's WebSocket carried
    assert set(frames) == set(ws_requests), (sorted(frames), sorted(ws_requests))
    for request_id, (_, frame) in frames.items():
        assert frame == ws_requests[request_id], request_id
        assert json.loads(frame)["encrypted_body"]["ciphertext"]
    # and every sealed chunk the node sent went back to the admitting replica untouched
    backs = _backs(run)
    node_chunks: dict[str, list[str]] = defaultdict(list)
    for _, frame in _ws_frames(run, from_node=True):
        if frame.get("type") == "inference_response_chunk":
            node_chunks[frame["request_id"]].append(frame["encrypted_data"]["ciphertext"])
    for request_id, (ticket, _) in frames.items():
        relayed = [m["e"]["ciphertext"] for m in backs[ticket] if m.get("k") == "chunk"]
        assert relayed == node_chunks[request_id], request_id
    for kind in SERVED:
        ticket = frames[run.sent[kind].request_id][0]
        assert [m["k"] for m in backs[ticket]][-1] == "complete" and len(node_chunks[run.sent[kind].request_id]) > 1, kind
    # the errors after dispatch: the node refused (or broke off) and the holder passed it back as an error
    errors = [m for ms in backs.values() for m in ms if m.get("k") == "error"]
    assert len(errors) >= 4, errors
    assert len(set(frames) - {run.sent[k].request_id for k in SERVED}) >= 4, sorted(frames)
    print(f"NATS capture: {len(run.decoded)} connections on port {NATS_PORT}, the replicas' published "
          f"{dict(subjects)}; {len(frames)} requests crossed ({sum(len(c) for c in node_chunks.values())} sealed "
          f"chunks relayed, {len(errors)} errors back); the subscriber heard {len(run.recorder.messages)}; "
          + ", ".join(f"{s.kind} {s.status} {s.completion[:40]!r}" for s in run.sent.values()))


def test_the_subscriber_and_the_wire_agree(run: Run) -> None:
    """The nats-py subscriber heard the run's messages, and each one is on the wire as a replica published it."""
    recorded = run.recorder.messages
    assert recorded, "the subscriber heard nothing under the run's prefix"
    wire = Counter((m.subject, m.payload) for m in run.replica_messages())
    heard = Counter((r.subject, r.data) for r in recorded if r.subject != f"{run.prefix}.probe")
    missing = [key for key in heard if key not in wire]
    assert not missing, missing[:5]
    ids = {run.sent[kind].request_id for kind in SERVED}
    in_holds = {json.loads(_body(r.data).partition(b"\n")[0]).get("r") for r in recorded if ".hold." in r.subject}
    assert ids <= in_holds, (sorted(ids), sorted(in_holds))
    claims = {r.reply for r in recorded if ".claim." in r.subject and r.reply}
    assert claims, "no claim request heard"
    answers = [r for r in run.recorder.inbox if r.subject in claims]
    assert answers and all(json.loads(_body(r.data)).get("ok") in (True, False) for r in answers), answers[:5]


def test_the_consumer_hop_shows_what_the_nats_hop_must_not(run: Run) -> None:
    """Positive control of the search itself: the consumer's HTTP connection to B is plaintext by
    design, and the same needles that must come back empty on NATS are found there."""
    plain = run.consumer("plain")
    assert len(plain) == 1 and not plain[0].to_server.gaps and not plain[0].to_client.gaps
    assert find_any(plain[0].to_server.data, {"canary": run.sent["plain"].canary.encode()})
    completion = {k: v for k, v in needles(run.sent["plain"]).items() if k.startswith("completion")}
    assert completion, run.sent["plain"].completion
    hits = {name for name, _, _ in find_any(plain[0].to_client.data, completion)}
    assert any(name.startswith("completion secret") for name in hits), sorted(hits)
    assert any(name.startswith("completion '") for name in hits), sorted(hits)
    for kind in ("sealed", "sealed_self_stream"):  # a sealed body hides it on that hop too
        connections = run.consumer(kind)
        assert len(connections) == 1 and ws_capture.SEALED.encode() in connections[0].request_head, kind
        assert not _leaks(run, {kind: connections[0].all_bytes}, [kind])


def _nats_haystacks(run: Run) -> dict[str, bytes]:
    haystacks: dict[str, bytes] = {"the NATS pcap file as written": run.pcap_bytes}
    for connection in run.nats.connections:  # every client of the server, the replicas' and anyone's
        haystacks[f"NATS tcp stream {connection.stream} (to the server)"] = connection.to_server.data
        haystacks[f"NATS tcp stream {connection.stream} (from the server)"] = connection.to_client.data
    for stream, decoded in run.decoded.items():
        haystacks[f"NATS tcp stream {stream}, decoded payloads"] = b"\n".join(
            m.subject.encode() + b" " + m.headers + m.payload for m in decoded.messages)
    haystacks["hold frames, parts joined"] = b"\n".join(frame for _, frame in _request_frames(run).values())
    haystacks["the subscriber's messages"] = b"\n".join(
        r.subject.encode() + b" " + json.dumps(r.headers).encode() + b" " + r.data
        for r in run.recorder.messages + run.recorder.inbox)
    return haystacks


def test_the_search_finds_a_canary_published_on_nats(run: Run) -> None:
    """The control of the leak search below: the canary this test published in the clear is found,
    as base64 and as text, in the pcap file, in the recorder's TCP stream both ways, in its decoded
    payloads and in what the subscriber heard."""
    [mine] = [stream for stream, d in run.decoded.items() if d.connect_options().get("name") == run.recorder.name]
    haystacks = _nats_haystacks(run)
    wanted = ["the NATS pcap file as written", f"NATS tcp stream {mine} (to the server)",
              f"NATS tcp stream {mine} (from the server)", f"NATS tcp stream {mine}, decoded payloads",
              "the subscriber's messages"]
    for where in wanted:
        hits = _leaks(run, {where: haystacks[where]}, ["planted"])
        names = " ".join(hits)
        assert "canary b64+1 " in names and "canary raw " in names, (where, hits)
        assert "completion 'planted text" in names, (where, hits)
    # and nowhere a replica wrote
    for name, stream in run.replica_streams.items():
        published = b"\n".join(m.payload for m in run.decoded[stream].messages if m.from_client)
        assert not _leaks(run, {name: published}, ["planted"]), name


def test_no_prompt_or_completion_in_any_nats_message(run: Run) -> None:
    haystacks = _nats_haystacks(run)
    assert sum(map(len, haystacks.values())) > 10_000, "too little NATS traffic to mean anything"
    leaks = _leaks(run, haystacks)
    assert not leaks, "plaintext on the replica↔replica hop:\n" + "\n".join(leaks[:40])


def test_no_prompt_or_completion_on_the_holders_provider_socket(run: Run) -> None:
    """The other hop of a cross-replica request (A to the node) carries ciphertext too."""
    assert run.ws, "no WebSocket message captured on the holder's port"
    leaks = _leaks(run, {"decoded WebSocket messages": b"\n".join(m.payload for m in run.ws),
                         "raw holder-port TCP bytes": b"\n".join(c.all_bytes for c in run.holder_port.connections)})
    assert not leaks, "\n".join(leaks[:40])


def test_error_messages_back_carry_no_request_text(run: Run) -> None:
    errors = [m for ms in _backs(run).values() for m in ms if m.get("k") in ("error", "gone", "busy")]
    assert errors
    leaks = _leaks(run, {"error messages back to the admitting replica": json.dumps(errors).encode()})
    assert not leaks, "\n".join(leaks[:40])


def test_no_prompt_or_completion_in_the_replicas_or_the_nodes_logs(run: Run) -> None:
    logs = {str(p): p.read_bytes() for coord in (run.a, run.b) for p in coord.home.glob("*.log")}
    logs[str(run.node_log)] = run.node_log.read_bytes()
    assert len(logs) == 3 and all(logs.values()), sorted(logs)
    leaks = _leaks(run, logs)
    assert not leaks, "\n".join(leaks[:40])
