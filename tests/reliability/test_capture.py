"""No prompt or completion byte crosses the coordinator↔provider WebSocket in the clear, and none is
logged or stored (docs/security.md "Consumer (anyone with an account and an API key)"; issue 12's
capture test).

One real coordinator (SQLite, its database inside its home) and one real linked node on the bundled
model, with tshark capturing every packet to and from the coordinator's port on loopback. Each kind
of request carries its own random canary and asks the model to repeat it, so the completion likely
contains it too: plain, streamed, exclusive (`X-Darkbloom-Route: self`, by the node's owner),
prefer, sealed body (non-streamed on the fleet, streamed under `self`), and errors the node raises
after dispatch (an invalid `top_k`, streamed and not; a prompt past the context window).

What is searched: for each request, its canary (as text, lower-cased, hex, and base64 in all three
alignments in both alphabets) and every 12-character window of the completion the client got
(as text and JSON-escaped) —
- in every WebSocket message of every `GET /ws/provider` connection, decoded here (unmasked,
  defragmented, inflated), in the raw bytes of those connections, and in tshark's own WebSocket
  dissection of the whole capture;
- for the sealed-body requests, in both directions of the consumer's own HTTP connection (the
  consumer hop is plaintext by design otherwise, and is used as the positive control: the plain
  request's canary must be found there, so a capture that saw nothing cannot pass);
- in the coordinator's and the node's logs, in the coordinator's SQLite database, -wal and -shm
  (read while the coordinator runs and again after it stopped), in a `sqlite3 .dump` of every table,
  and in every file under the coordinator's home.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import sqlite3
import subprocess
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from nacl.public import Box, PrivateKey

from darkbloom.wire.crypto import b64d, b64e, public_key_from_b64
from tests.support.accounts import Account, create_account, login_node, start_node, wait_model_listed
from tests.support.capture import (CaptureUnavailable, Connection, Direction, Tshark, WsMessage, context, find_any,
                                   fragment_forms, fragments, read_connections, secret_forms,
                                   tshark_websocket_text, websocket_messages)
from tests.support.processes import Coordinator, Process, free_port, start_coordinator

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"
SEALED = "application/darkbloom-sealed+json"
TAG = "X-Capture-Tag"  # the test's own header: which consumer connection carried which request


@dataclass
class Sent:
    """One request of the run and what came back."""

    kind: str
    canary: str
    status: int = 0
    request_id: str = ""
    completion: str = ""
    error: str = ""

    def needles(self) -> dict[str, bytes]:
        found = {f"canary {name}": form for name, form in secret_forms(self.canary).items()}
        core = self.canary.removeprefix("Canary")  # the random part alone, should the prefix be split off
        found.update({f"canary-core {name}": form for name, form in secret_forms(core).items()})
        for fragment in fragments(self.completion):
            for form in fragment_forms(fragment):
                found[f"completion {fragment!r}"] = form
        return found


@dataclass(repr=False)  # its bytes would fill a failure report
class Run:
    coordinator: Coordinator
    node: Process
    node_home: Path
    sent: dict[str, Sent]
    connections: list[Connection]
    ws_messages: list[WsMessage]
    ws_problems: list[str]
    ws_raw: bytes
    tshark_ws: str
    dropped: str | None
    snapshots: dict[str, bytes] = field(default_factory=dict)  # files read while the coordinator ran

    def __repr__(self) -> str:
        return f"Run({len(self.connections)} connections, {len(self.ws_messages)} WebSocket messages)"

    def consumer(self, kind: str) -> list[Connection]:
        return [c for c in self.connections if c.header(TAG) == kind]


def _prompt(canary: str) -> str:
    return f"Repeat this code exactly, three times, and nothing else: {canary} {canary} {canary}"


def _body(sent: Sent, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": _prompt(sent.canary)}],
            "max_tokens": 48, "temperature": 0, **extra}


def _post(coord: Coordinator, account: Account, sent: Sent, content: bytes, content_type: str = "application/json",
          headers: dict[str, str] | None = None) -> httpx.Response:
    # a client of its own: one TCP connection per request, so each is found again in the capture
    with httpx.Client(timeout=120) as client:
        response = client.post(coord.api_url + "/chat/completions", content=content, headers={
            **account.headers(), "Content-Type": content_type, TAG: sent.kind, **(headers or {})})
    sent.status = response.status_code
    sent.request_id = response.headers.get("x-request-id", "")
    return response


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def _completion_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(choice.get("delta", {}).get("content") or "" for chunk in chunks
                   for choice in chunk.get("choices", []))


def _plain(coord: Coordinator, account: Account, sent: Sent, headers: dict[str, str] | None = None) -> None:
    response = _post(coord, account, sent, json.dumps(_body(sent)).encode(), headers=headers)
    assert response.status_code == 200, (sent.kind, response.text)
    sent.completion = response.json()["choices"][0]["message"]["content"] or ""


def _streamed(coord: Coordinator, account: Account, sent: Sent, headers: dict[str, str] | None = None) -> None:
    body = _body(sent, stream=True, stream_options={"include_usage": True})
    response = _post(coord, account, sent, json.dumps(body).encode(), headers=headers)
    assert response.status_code == 200, (sent.kind, response.text)
    sent.completion = _completion_of([json.loads(event) for event in _events(response.text)])


def _sealed(coord: Coordinator, account: Account, sent: Sent, stream: bool,
            headers: dict[str, str] | None = None) -> None:
    key = httpx.get(coord.api_url + "/encryption-key").json()
    ephemeral = PrivateKey.generate()
    box = Box(ephemeral, public_key_from_b64(key["public_key"]))
    body = _body(sent, **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}))
    envelope = {"kid": key["kid"], "ephemeral_public_key": b64e(bytes(ephemeral.public_key)),
                "ciphertext": b64e(bytes(box.encrypt(json.dumps(body).encode())))}
    response = _post(coord, account, sent, json.dumps(envelope).encode(), SEALED, headers)
    assert response.status_code == 200, (sent.kind, response.text)
    if stream:
        chunks = [json.loads(box.decrypt(b64d(json.loads(event)["ciphertext"]))) for event in _events(response.text)]
        sent.completion = _completion_of(chunks)
    else:
        answer = json.loads(box.decrypt(b64d(response.json()["ciphertext"])))
        sent.completion = answer["choices"][0]["message"]["content"] or ""


def _failing(coord: Coordinator, account: Account, sent: Sent, body: dict[str, Any]) -> None:
    response = _post(coord, account, sent, json.dumps(body).encode())
    sent.error = response.text
    if body.get("stream") and response.status_code == 200:  # an error event inside the stream
        assert "error" in response.text, (sent.kind, response.text)
    else:
        assert response.status_code >= 400, (sent.kind, response.status_code, response.text)


def _send_all(coord: Coordinator, owner: Account, consumer: Account) -> dict[str, Sent]:
    kinds = ["plain", "stream", "self", "prefer", "sealed", "sealed_self_stream",
             "error_param", "error_param_stream", "error_context"]
    sent = {kind: Sent(kind, "Canary" + secrets.token_hex(8)) for kind in kinds}
    _plain(coord, consumer, sent["plain"])
    _streamed(coord, consumer, sent["stream"])
    _plain(coord, owner, sent["self"], {"X-Darkbloom-Route": "self"})
    _streamed(coord, owner, sent["prefer"], {"X-Darkbloom-Route": "prefer"})
    _sealed(coord, consumer, sent["sealed"], stream=False)
    _sealed(coord, owner, sent["sealed_self_stream"], stream=True, headers={"X-Darkbloom-Route": "self"})
    # the coordinator passes top_k through; the node's llama.cpp backend refuses -1 (400 after dispatch)
    _failing(coord, consumer, sent["error_param"], _body(sent["error_param"], top_k=-1))
    _failing(coord, consumer, sent["error_param_stream"], _body(sent["error_param_stream"], top_k=-1, stream=True))
    # past the model's 2048-token window: llama.cpp's own exception quotes token counts, maybe more
    long_prompt = " ".join([sent["error_context"].canary] * 700)
    _failing(coord, consumer, sent["error_context"],
             {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 16})
    return sent


def _files_under(root: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def _sqlite_dump(db: Path) -> bytes:
    """Every table as SQL text: the sqlite3 CLI's `.dump` where installed, Python's iterdump otherwise."""
    if shutil.which("sqlite3"):
        return subprocess.run(["sqlite3", f"file:{db}?mode=ro", ".dump"], capture_output=True, timeout=60,
                              check=True).stdout
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return "\n".join(conn.iterdump()).encode()


def _snapshot(coord_home: Path, db: Path) -> dict[str, bytes]:
    files = _files_under(coord_home)  # the database, its -wal and -shm, logs, keys: everything
    files[f"sqlite3 .dump of {db.name}"] = _sqlite_dump(db)
    return files


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("capture")
    port = free_port()
    try:
        capture = Tshark(port, root / "coordinator-port.pcap")
    except CaptureUnavailable as exc:
        pytest.skip(f"no packet capture here: {exc}")
    coord_home, node_home = root / "coordinator", root / "node"
    db = coord_home / "coordinator.db"
    coord: Coordinator | None = None
    node: Process | None = None
    try:
        coord_home.mkdir()
        coord = start_coordinator(coord_home, f"sqlite+aiosqlite:///{db}", port=port)
        owner = create_account(coord, credit_micro_usd=10_000_000)
        consumer = create_account(coord, credit_micro_usd=10_000_000)
        login_node(coord, node_home, owner)
        node = start_node(coord, node_home, "--max-concurrency", "2")
        wait_model_listed(coord, owner)
        sent = _send_all(coord, owner, consumer)
        time.sleep(1.0)  # usage rows and log lines land; the WAL still holds them
        snapshots = {f"(running) {name}": data for name, data in _snapshot(coord_home, db).items()}
    finally:
        if node is not None:
            node.stop()
        if coord is not None:
            coord.stop()
        capture.stop()
    connections = read_connections(capture.pcap, port)
    messages: list[WsMessage] = []
    problems: list[str] = []
    raw = b""
    for connection in connections:
        if connection.is_provider_socket():
            decoded = websocket_messages(connection)
            messages += decoded.messages
            problems += decoded.problems
            raw += connection.all_bytes
    yield Run(coord, node, node_home, sent, connections, messages, problems, raw,
              tshark_websocket_text(capture.pcap), capture.dropped(), snapshots)


def _leaks(sent: dict[str, Sent], haystacks: dict[str, bytes], kinds: list[str] | None = None) -> list[str]:
    report = []
    for kind in kinds or list(sent):
        needles = sent[kind].needles()
        for where, haystack in haystacks.items():
            for name, needle, at in find_any(haystack, needles):
                report.append(f"{kind}: {name} = {needle!r} in {where} at byte {at}: "
                              f"…{context(haystack, at)!r}…")
    return report


def _frame_types(run: Run) -> dict[str, list[dict[str, Any]]]:
    by_type: dict[str, list[dict[str, Any]]] = {}
    for message in run.ws_messages:
        if message.opcode in (1, 2):
            frame = json.loads(message.payload)
            by_type.setdefault(frame.get("type", "?"), []).append(frame)
    return by_type


def test_the_capture_saw_the_provider_socket_and_every_dispatch(run: Run) -> None:
    """Guards the other tests: a capture that missed the traffic, or a decoder that misread it,
    would find no leak for the wrong reason."""
    assert run.dropped is None, f"tshark dropped packets: {run.dropped}"
    sockets = [c for c in run.connections if c.is_provider_socket()]
    assert sockets, "no GET /ws/provider connection in the capture"
    assert not run.ws_problems, run.ws_problems
    frames = _frame_types(run)
    assert frames.get("register") and frames.get("registered"), sorted(frames)
    dispatched = {frame["request_id"] for frame in frames.get("inference_request", [])}
    refused = {frame["request_id"] for frame in frames.get("inference_error", [])}
    for sent in run.sent.values():
        assert sent.request_id, f"{sent.kind}: no X-Request-Id ({sent.status})"
        if not sent.kind.startswith("error"):  # (the over-long prompt may be refused before dispatch)
            assert sent.request_id in dispatched, f"{sent.kind} ({sent.request_id}) never reached the node"
    # the two invalid-top_k requests reached the node and it refused them
    top_k = {run.sent[kind].request_id for kind in ("error_param", "error_param_stream")}
    assert len(top_k) == 2 and top_k <= dispatched & refused, (sorted(top_k), sorted(dispatched), sorted(refused))
    answered = {frame["request_id"] for frame in frames.get("inference_response_chunk", [])}
    for kind in ("plain", "stream", "self", "prefer", "sealed", "sealed_self_stream"):
        assert run.sent[kind].request_id in answered, f"{kind}: no response chunk captured"
        assert run.sent[kind].completion.strip(), f"{kind}: empty completion"
    # the consumer hop is plaintext by design: the plain request's canary is there for all to see
    # and so is its completion: the same search that must come back empty elsewhere finds both here
    plain = run.consumer("plain")
    assert len(plain) == 1 and not plain[0].to_server.gaps and not plain[0].to_client.gaps
    assert find_any(plain[0].to_server.data, {"canary": run.sent["plain"].canary.encode()})
    fragment_needles = {k: v for k, v in run.sent["plain"].needles().items() if k.startswith("completion")}
    assert fragment_needles, f"no completion fragment to search for in {run.sent['plain'].completion!r}"
    assert find_any(plain[0].to_client.data, fragment_needles)


def test_no_canary_or_completion_in_any_websocket_frame(run: Run) -> None:
    decoded = b"\n".join(m.payload for m in run.ws_messages)
    leaks = _leaks(run.sent, {"decoded WebSocket messages": decoded, "raw /ws/provider TCP bytes": run.ws_raw,
                              "tshark's WebSocket dissection (PDML)": run.tshark_ws.encode()})
    assert not leaks, "plaintext on the coordinator↔provider hop:\n" + "\n".join(leaks[:40])


def test_error_frames_carry_no_request_text(run: Run) -> None:
    errors = _frame_types(run).get("inference_error", [])
    assert len(errors) >= 2, "the node's refusals were not seen on the socket"
    leaks = _leaks(run.sent, {"inference_error frames": json.dumps(errors).encode()})
    assert not leaks, "\n".join(leaks[:40])


def test_a_sealed_body_hides_the_request_on_the_consumer_hop_too(run: Run) -> None:
    for kind in ("sealed", "sealed_self_stream"):
        connections = run.consumer(kind)
        assert len(connections) == 1, f"{kind}: {len(connections)} consumer connections in the capture"
        assert SEALED.encode() in connections[0].request_head
        assert not connections[0].to_server.gaps and not connections[0].to_client.gaps
        leaks = _leaks(run.sent, {f"{kind}'s consumer connection": connections[0].all_bytes}, [kind])
        assert not leaks, "plaintext on a sealed consumer connection:\n" + "\n".join(leaks[:40])


def test_no_canary_or_completion_in_logs(run: Run) -> None:
    logs = {str(p): p.read_bytes() for home in (run.coordinator.home, run.node_home) for p in home.glob("*.log")}
    assert any("coordinator" in name for name in logs) and any("node" in name for name in logs), sorted(logs)
    assert all(logs.values()), "an empty log proves nothing"
    leaks = _leaks(run.sent, logs)
    assert not leaks, "\n".join(leaks[:40])


def test_no_canary_or_completion_in_the_database_or_the_coordinators_home(run: Run) -> None:
    after = _files_under(run.coordinator.home)
    db = run.coordinator.home / "coordinator.db"
    after[f"sqlite3 .dump of {db.name} (stopped)"] = _sqlite_dump(db)
    names = " ".join(run.snapshots)
    assert "(running)" in names and str(db) in names, "the database was not read while the coordinator ran"
    assert b"CREATE TABLE" in after[f"sqlite3 .dump of {db.name} (stopped)"]
    leaks = _leaks(run.sent, {**run.snapshots, **after})
    assert not leaks, "\n".join(leaks[:40])


# --- the search itself, on bytes made here ------------------------------------------------------


@pytest.mark.parametrize("lead", [0, 1, 2, 3, 4, 5])
def test_base64_of_a_secret_is_found_at_any_alignment(lead: int) -> None:
    canary = "Canary" + secrets.token_hex(8)
    blob = secrets.token_bytes(lead) + canary.encode() + secrets.token_bytes(7)
    haystack = b'{"ciphertext":"' + base64.b64encode(blob) + b'"} ' + base64.urlsafe_b64encode(blob)
    hits = {name for name, _, _ in find_any(haystack, secret_forms(canary))}
    assert f"b64+{lead % 3}" in hits and f"b64url+{lead % 3}" in hits
    assert not find_any(base64.b64encode(secrets.token_bytes(64)), secret_forms(canary))


def _frame(payload: bytes, opcode: int, fin: bool, rsv1: bool, mask: bool) -> bytes:
    head = bytes([(0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode])
    length = len(payload)
    size = bytes([length]) if length < 126 else (bytes([126]) + length.to_bytes(2, "big") if length < 65536
                                                  else bytes([127]) + length.to_bytes(8, "big"))
    if not mask:
        return head + size + payload
    key = secrets.token_bytes(4)
    return head + bytes([size[0] | 0x80]) + size[1:] + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def test_the_decoder_unmasks_joins_fragments_and_inflates() -> None:
    """permessage-deflate is off today (the node connects with compression=None); should it be
    turned on, the capture must still read the frames' text."""
    texts = [json.dumps({"type": "heartbeat", "n": i, "pad": "x" * (200 * i)}).encode() for i in range(4)]
    deflater = zlib.compressobj(wbits=-15)
    client = b""
    for text in texts:  # context taken over from message to message, the second one in two fragments
        data = deflater.compress(text) + deflater.flush(zlib.Z_SYNC_FLUSH)
        data = data[:-4]
        if text is texts[1]:
            half = len(data) // 2
            client += _frame(data[:half], 1, False, True, True) + _frame(b"", 9, True, False, True)
            client += _frame(data[half:], 0, True, False, True)
        else:
            client += _frame(data, 1, True, True, True)
    server = b"HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Extensions: permessage-deflate\r\n\r\n"
    server += _frame(b'{"type":"registered"}', 1, True, False, False)
    connection = Connection(0, 1, Direction(b"GET /ws/provider HTTP/1.1\r\n\r\n" + client, []),
                            Direction(server, []))
    decoded = websocket_messages(connection)
    assert not decoded.problems, decoded.problems
    assert [m.payload for m in decoded.messages if m.opcode == 1] == [*texts, b'{"type":"registered"}']
