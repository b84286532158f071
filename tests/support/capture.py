"""Packet capture on loopback with Debian's tshark, and what the capture tests read out of it.

`Tshark` runs `tshark -i lo -f "tcp port P" -w FILE` for the length of a test; `read_connections`
turns the pcap into one `Connection` per TCP connection (both directions reassembled from
`tcp.payload` by sequence number, gaps reported); `websocket_messages` decodes a connection that
upgraded on `GET /ws/provider` into its messages (client frames unmasked, fragments joined,
permessage-deflate inflated when negotiated), independently of tshark's own dissector, which
`tshark_websocket_text` reads as a cross-check. `secret_forms` / `fragment_forms` give the byte
strings a leak of a secret or of a completion could take: the text itself, its hex, its base64 in
all three alignments (standard and URL-safe alphabets) and its JSON-escaped forms.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

TSHARK = shutil.which("tshark")


class CaptureUnavailable(Exception):
    """tshark is missing or may not capture on this machine (the test skips with this reason)."""


class Tshark:
    """`tshark -i lo -f "tcp port PORT" -w PCAP`, started before the traffic and stopped after it."""

    def __init__(self, port: int, pcap: Path, max_seconds: int = 600) -> None:
        if TSHARK is None:
            raise CaptureUnavailable("tshark is not installed (Debian package `tshark`; `make install` "
                                     "installs it, or run `sudo apt-get install -y tshark`)")
        self.pcap = pcap
        self._stderr_path = pcap.with_suffix(".tshark.log")
        self._stderr = open(self._stderr_path, "wb")
        # -B: a 64 MiB kernel buffer so no burst on loopback is dropped; -a: never outlive the test
        self.proc = subprocess.Popen(
            [TSHARK, "-i", "lo", "-f", f"tcp port {port}", "-B", "64", "-s", "0", "-q",
             "-a", f"duration:{max_seconds}", "-w", str(pcap)],
            stdout=subprocess.DEVNULL, stderr=self._stderr)
        # "Capturing on 'lo'" comes before dumpcap has the socket (a permission error follows it);
        # "Capture started" (or a capture file that stays open a while) comes after
        deadline, announced = time.monotonic() + 30, None
        while True:
            log = self.log()
            if self.proc.poll() is not None:
                raise CaptureUnavailable(f"tshark cannot capture on lo here (exit {self.proc.returncode}): "
                                         f"{log.strip()[-600:]}")
            if "Capture started" in log:
                break
            if announced is None and "Capturing on" in log:
                announced = time.monotonic()
            if announced is not None and time.monotonic() - announced > 2 and pcap.exists() \
                    and pcap.stat().st_size > 0 and "permission" not in log.lower():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise CaptureUnavailable(f"tshark did not start capturing within 30 s: {log.strip()[-600:]}")
            time.sleep(0.05)
        time.sleep(0.3)  # a margin for the filter to be attached all the same

    def log(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            time.sleep(0.5)  # let the last packets reach the ring buffer
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def dropped(self) -> str | None:
        """tshark's own 'N packets dropped' line, if the kernel dropped any."""
        for line in self.log().splitlines():
            if "dropped" in line.lower() and not line.strip().startswith("0 packets"):
                return line.strip()
        return None


@dataclass
class Direction:
    data: bytes
    gaps: list[tuple[int, int]]  # (offset, length) ranges never seen in the capture


@dataclass
class Connection:
    stream: int
    client_port: int
    to_server: Direction
    to_client: Direction

    @property
    def request_head(self) -> bytes:
        """The client's first HTTP request head (request line and headers)."""
        return self.to_server.data.split(b"\r\n\r\n", 1)[0]

    def is_provider_socket(self) -> bool:
        return self.to_server.data.startswith(b"GET /ws/provider")

    def header(self, name: str) -> str | None:
        """A header of the first request, e.g. the test's own `X-Capture-Tag`."""
        for line in self.request_head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower().encode():
                return value.strip().decode(errors="replace")
        return None

    @property
    def all_bytes(self) -> bytes:
        return self.to_server.data + b"\n" + self.to_client.data


def _reassemble(segments: list[tuple[int, bytes]]) -> Direction:
    """Payloads by relative sequence number (tshark's `tcp.seq`, data starts at 1) into one stream;
    retransmitted bytes are taken once, missing ranges reported."""
    if not segments:
        return Direction(b"", [])
    end = max(seq + len(payload) for seq, payload in segments)
    buffer = bytearray(end - 1)
    seen = bytearray(end - 1)
    for seq, payload in segments:
        start = seq - 1
        buffer[start:start + len(payload)] = payload
        seen[start:start + len(payload)] = b"\x01" * len(payload)
    gaps: list[tuple[int, int]] = []
    offset = seen.find(0)
    while offset != -1:
        stop = seen.find(1, offset)
        stop = len(seen) if stop == -1 else stop
        gaps.append((offset, stop - offset))
        offset = seen.find(0, stop)
    return Direction(bytes(buffer), gaps)


def read_connections(pcap: Path, server_port: int) -> list[Connection]:
    """Every TCP connection to `server_port` in the capture, both directions reassembled."""
    assert TSHARK is not None
    fields = subprocess.run(
        [TSHARK, "-r", str(pcap), "-o", "tcp.relative_sequence_numbers:TRUE", "-Y", "tcp.len > 0",
         "-T", "fields", "-E", "separator=|", "-e", "tcp.stream", "-e", "tcp.srcport", "-e", "tcp.dstport",
         "-e", "tcp.seq", "-e", "tcp.payload"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    segments: dict[tuple[int, bool], list[tuple[int, bytes]]] = {}
    client_ports: dict[int, int] = {}
    for line in fields.splitlines():
        stream, src, dst, seq, payload = line.split("|")
        to_server = int(dst) == server_port
        client_ports[int(stream)] = int(src) if to_server else int(dst)
        segments.setdefault((int(stream), to_server), []).append(
            (int(seq), bytes.fromhex(payload.replace(":", ""))))
    return [Connection(stream, port, _reassemble(segments.get((stream, True), [])),
                       _reassemble(segments.get((stream, False), [])))
            for stream, port in sorted(client_ports.items())]


@dataclass
class WsMessage:
    from_client: bool
    opcode: int
    payload: bytes  # unmasked, defragmented, inflated


@dataclass
class WsDecode:
    messages: list[WsMessage] = field(default_factory=list)
    extensions: str = ""
    problems: list[str] = field(default_factory=list)  # anything that stopped a clean decode


def _http_head(data: bytes) -> tuple[bytes, bytes]:
    head, sep, rest = data.partition(b"\r\n\r\n")
    return (head, rest) if sep else (data, b"")


def _frames(data: bytes, from_client: bool, deflate: bool, out: WsDecode) -> None:
    inflater = zlib.decompressobj(-15)  # a 2^15 window reads every smaller negotiated window too
    offset, parts, opcode, compressed = 0, [], 0, False
    while offset < len(data):
        if len(data) - offset < 2:
            out.problems.append(f"{'client' if from_client else 'server'}: {len(data) - offset} trailing bytes")
            return
        b0, b1 = data[offset], data[offset + 1]
        fin, rsv1, op = b0 & 0x80, b0 & 0x40, b0 & 0x0F
        masked, length = b1 & 0x80, b1 & 0x7F
        pos = offset + 2
        if length == 126:
            length, pos = int.from_bytes(data[pos:pos + 2], "big"), pos + 2
        elif length == 127:
            length, pos = int.from_bytes(data[pos:pos + 8], "big"), pos + 8
        mask = b""
        if masked:
            mask, pos = data[pos:pos + 4], pos + 4
        payload = data[pos:pos + length]
        if len(payload) < length:
            out.problems.append(f"{'client' if from_client else 'server'}: frame cut short "
                                f"({len(payload)} of {length} bytes)")
            return
        if masked:
            key = (mask * (length // 4 + 1))[:length]
            payload = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(length, "big")
        offset = pos + length
        if op >= 0x8:  # control frames may sit between fragments
            out.messages.append(WsMessage(from_client, op, payload))
            continue
        if op != 0:
            opcode, compressed, parts = op, bool(rsv1) and deflate, []
        parts.append(payload)
        if fin:
            message = b"".join(parts)
            if compressed:
                try:
                    message = inflater.decompress(message + b"\x00\x00\xff\xff")
                except zlib.error as exc:
                    out.problems.append(f"inflate failed: {exc}")
                    return
            out.messages.append(WsMessage(from_client, opcode, message))
            parts = []


def websocket_messages(connection: Connection) -> WsDecode:
    """The messages of an upgraded connection, in each direction's order."""
    out = WsDecode()
    request, client_frames = _http_head(connection.to_server.data)
    response, server_frames = _http_head(connection.to_client.data)
    if not response.startswith(b"HTTP/1.1 101"):
        out.problems.append("no 101 Switching Protocols: " + response[:80].decode(errors="replace"))
        return out
    for line in response.split(b"\r\n"):
        if line.lower().startswith(b"sec-websocket-extensions:"):
            out.extensions = line.split(b":", 1)[1].strip().decode()
    deflate = "permessage-deflate" in out.extensions
    for direction in (connection.to_server, connection.to_client):
        if direction.gaps:
            out.problems.append(f"capture gaps {direction.gaps[:5]}")
    _frames(client_frames, True, deflate, out)
    _frames(server_frames, False, deflate, out)
    return out


def tshark_websocket_text(pcap: Path) -> str:
    """tshark's own WebSocket dissection (unmasked, and inflated where it can): every field of every
    `websocket` packet as text, for a second, independent search of the same frames."""
    assert TSHARK is not None
    return subprocess.run([TSHARK, "-r", str(pcap), "-Y", "websocket", "-T", "pdml"],
                          capture_output=True, text=True, timeout=300, check=True).stdout


# --- what a leak looks like ---------------------------------------------------------------------


def _b64_aligned(secret: bytes) -> dict[str, bytes]:
    """The part of base64(prefix ‖ secret) fixed by the secret alone, for prefixes of 0, 1 and 2 bytes:
    whichever byte offset the secret starts at inside a base64-encoded blob, one of these appears."""
    forms: dict[str, bytes] = {}
    for lead in range(3):
        for alphabet, encode in (("b64", base64.b64encode), ("b64url", base64.urlsafe_b64encode)):
            encoded = encode(b"\x00" * lead + secret)
            first = -(-lead // 3) * 3  # first whole group holding only secret bytes
            last = (lead + len(secret)) // 3 * 3  # end of the last whole group
            forms[f"{alphabet}+{lead}"] = encoded[first // 3 * 4:last // 3 * 4]
    return forms


def secret_forms(secret: str) -> dict[str, bytes]:
    raw = secret.encode()
    return {"raw": raw, "lower": secret.lower().encode(), "hex": raw.hex().encode(), **_b64_aligned(raw)}


def fragments(text: str, length: int = 12) -> list[str]:
    """Every `length`-character window of a completion that is specific enough to mean something
    (at least half letters or digits, and at least six distinct characters: a window such as
    `000000000000` also spells the all-zero MAC addresses of loopback packets in tshark's output),
    once each."""
    seen: dict[str, None] = {}
    for start in range(max(0, len(text) - length + 1)):
        window = text[start:start + length]
        if sum(ch.isalnum() for ch in window) >= length // 2 and len(set(window)) >= 6:
            seen.setdefault(window, None)
    return list(seen)


def fragment_forms(fragment: str) -> list[bytes]:
    forms = {fragment.encode(), json.dumps(fragment)[1:-1].encode(),
             json.dumps(fragment, ensure_ascii=False)[1:-1].encode()}
    return sorted(forms)


def find_any(haystack: bytes, needles: dict[str, bytes]) -> list[tuple[str, bytes, int]]:
    """(name, needle, offset) for each needle present."""
    hits = []
    for name, needle in needles.items():
        if needle and (at := haystack.find(needle)) != -1:
            hits.append((name, needle, at))
    return hits


def context(haystack: bytes, offset: int, width: int = 80) -> bytes:
    return haystack[max(0, offset - width):offset + width]


# --- the NATS client protocol (issue 14's capture of the replicas' traffic) ----------------------


@dataclass
class NatsMessage:
    """One message of the NATS text protocol: a client's ``PUB``/``HPUB`` or the server's ``MSG``/``HMSG``."""

    from_client: bool
    op: str
    subject: str
    reply: str
    headers: bytes  # the NATS/1.0 header block of HPUB/HMSG (empty otherwise)
    payload: bytes


@dataclass
class NatsDecode:
    messages: list[NatsMessage] = field(default_factory=list)
    control: list[bytes] = field(default_factory=list)  # CONNECT, INFO, SUB, UNSUB, PING, PONG, +OK, -ERR lines
    problems: list[str] = field(default_factory=list)   # anything that stopped a clean decode

    def connect_options(self) -> dict[str, object]:
        """The client's CONNECT JSON (its ``name`` among them), or {} when the capture missed it."""
        for line in self.control:
            if line[:8].upper() == b"CONNECT ":
                try:
                    return dict(json.loads(line[8:]))
                except ValueError:
                    return {}
        return {}

    def subscriptions(self) -> list[str]:
        return [line.split()[1].decode(errors="replace") for line in self.control
                if line[:4].upper() == b"SUB " and len(line.split()) >= 3]


_NATS_CONTROL = {"CONNECT", "INFO", "SUB", "UNSUB", "PING", "PONG", "+OK", "-ERR"}


def _nats_ops(data: bytes, from_client: bool, out: NatsDecode) -> None:
    side = "client" if from_client else "server"
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n", pos)
        if end == -1:
            out.problems.append(f"{side}: {len(data) - pos} bytes of an unterminated line")
            return
        line, pos = data[pos:end], end + 2
        op = line.split(b" ", 1)[0].split(b"\t", 1)[0].upper().decode(errors="replace")
        if op in _NATS_CONTROL:
            out.control.append(line)
            continue
        if op not in ("PUB", "HPUB", "MSG", "HMSG"):
            out.problems.append(f"{side}: unknown operation {line[:60]!r}")
            return
        args = line.split()[1:]
        # PUB subj [reply] n | HPUB subj [reply] h n | MSG subj sid [reply] n | HMSG subj sid [reply] h n
        fixed = {"PUB": 2, "HPUB": 3, "MSG": 3, "HMSG": 4}[op]
        try:
            if len(args) not in (fixed, fixed + 1):
                raise ValueError(len(args))
            subject = args[0].decode()
            with_sid = op in ("MSG", "HMSG")
            reply = args[1 + with_sid].decode() if len(args) == fixed + 1 else ""
            total = int(args[-1])
            header_length = int(args[-2]) if op in ("HPUB", "HMSG") else 0
        except (ValueError, UnicodeDecodeError):
            out.problems.append(f"{side}: malformed {op} line {line[:120]!r}")
            return
        body = data[pos:pos + total]
        if len(body) < total or data[pos + total:pos + total + 2] != b"\r\n":
            out.problems.append(f"{side}: {op} {subject} cut short ({len(body)} of {total} bytes)")
            return
        pos += total + 2
        out.messages.append(NatsMessage(from_client, op, subject, reply, body[:header_length], body[header_length:]))


def nats_messages(connection: Connection) -> NatsDecode:
    """Every operation of a NATS client connection, both directions (a connection captured from its
    start: its first client line is CONNECT, the server's INFO)."""
    out = NatsDecode()
    for direction, from_client in ((connection.to_server, True), (connection.to_client, False)):
        if direction.gaps:
            out.problems.append(f"capture gaps {direction.gaps[:5]}")
        _nats_ops(direction.data, from_client, out)
    return out
