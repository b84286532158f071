"""Issue 18's attacker, as a test suite: anyone who can reach NATS but holds no replica's key.

Two real replicas of one coordinator (Postgres, Redis, the machine's NATS under the set's own
subject prefix): replica A holds every machine — a hand-driven `ThreadedRaw` provider owned by the victim
(public, answers at once), hand-held `ThreadedRaw` providers that answer when a test says (model ``HELD``),
and a real `darkbloom serve` node on the bundled model (private-only) — and every consumer calls
replica B, so every request crosses NATS.

The attacker is a plain `nats.connect` client with no key. It subscribes to ``<prefix>.>`` and learns
what a real one would (the replicas' ids from the proof lines, the sessions' ids, accounts,
machines and X25519 keys from the announcements, the tickets, request ids and ephemeral keys from
the hold messages) and publishes, each time with no proof line, with a well-formed proof line whose
tag is random (posing as the replica it names: ``bad_signature``; with a huge ``seq``, which must
not move the replay window either) and with one naming a replica that does not exist
(``unknown_replica``):

1. a fleet announcement of a fake session on the victim's account and machine with the attacker's
   X25519 key: the victim's self-routed requests are never sealed to it, never claimed or held on
   it, it never shows in the victim's machines, and its bait model gets a Self-Route error;
2. the same on the attacker's own account: paid requests never go to it, the attacker earns nothing;
3. chunks, a completion, an error and ``gone`` on a live request's back subject, sealed to the
   request's ephemeral key: the consumer's answer and the usage row are the real provider's only;
4. an ``inference_request`` on the holder, sealed to a machine's announced key (free inference):
   neither the hand-driven machine nor the real node gets anything, no usage row, nothing comes back;
5. a request message reusing a live request id (a new one, and the real one replayed): the live
   stream completes normally and its machine got its request once;
6. ``leaving``, a heartbeat with no sessions and an empty full view for A, asks for B's full view,
   claims (request/reply, no answer), a
   ``complete`` with ``account_id: null``, release, cancel, an untrusted ``trust_status``, unlink,
   speed, and 200 × 1 MB first parts of split request frames: A's machines stay listed everywhere,
   free, owned, trusted and connected, the held request completes, A's memory does not grow;
7. a ``trust_status`` with a junk certificate, as a request message and as a frame: no machine
   receives it, the real node writes no certificate.pem;
8. answers to every claim on A, on each claim's reply inbox before A can answer (garbage, a bare
   refusal, a refusal posing as A, as A at a huge sequence number, as a replica that does not exist):
   B waits past them for A's own answer, and a machine of two slots, one held busy, serves its
   owner's requests from B one after another;

plus replays of real messages captured off the wire (a back chunk, a fleet announcement, a hold
request), dropped as ``replayed`` with no chunk twice in the answer, and the proof-line forgeries
counted as ``bad_signature`` / ``unknown_replica``.

Every row ends with the positive control — a paid request on B served across NATS by the victim's
machine and billed normally (and, where the real node is the target, a self-routed one served by
it) — so a fabric that broke would not pass.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import nats
import pytest
from nacl.exceptions import CryptoError
from nacl.public import Box, PrivateKey, PublicKey

from darkbloom.coordinator.fabric import messages
from darkbloom.store.schema import usage_records
from darkbloom.wire.crypto import ReplyKey, Sealer, b64d, b64e, public_key_from_b64
from darkbloom.wire.protocol import InferenceRequest, TrustStatus, dump
from darkbloom.wire.runtime import runtime_hash

from tests.support.billing import node_home, start_serve, table, wait_registered
from tests.support.accounts import Account, create_account, device_token
from tests.support.processes import Coordinator, Process, wait_until
from tests.support.raw_provider import ThreadedRaw
from tests.support.replicas import NATS_URL, Replicas, readyz, replica_set

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"  # the victim's public machine and the real node
HELD = "held-model"     # the hand-held machines only: paid requests for MODEL never land on them
BAIT = "bait-model"     # served by nobody real: only a fake session could serve it
SELF = {"X-Darkbloom-Route": "self"}
HONEST_ANSWER = "served by the victim's machine"
INJECTED = "INJECTED-BY-THE-ATTACKER"
MB = 1_000_000
MAX_PROOF = 512


# --- the attacker ------------------------------------------------------------------------------------


@dataclass
class Heard:
    subject: str
    data: bytes
    reply: str

    @property
    def proof(self) -> list[str] | None:
        line, newline, _ = self.data.partition(b"\n")
        return line.decode(errors="replace").split(" ") if newline and line.startswith(b"DBA1 ") else None

    @property
    def sender(self) -> str | None:
        proof = self.proof
        return proof[1] if proof else None

    @property
    def body(self) -> bytes:
        return self.data.partition(b"\n")[2] if self.proof else self.data

    def hold(self) -> tuple[dict[str, Any], bytes]:
        header, _, payload = self.body.partition(b"\n")
        return json.loads(header), payload


class Attacker:
    """A plain NATS client, no key: hears everything under the prefix (not its own messages) and
    publishes whatever it likes, on its own thread."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.heard: list[Heard] = []
        self.x25519 = PrivateKey.generate()  # the key its fake sessions announce
        self._forged = 0
        self.newest: dict[str, int] = {}  # the newest sequence number heard from each sender
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.nc = self._call(nats.connect(NATS_URL, name="attacker", no_echo=True))
        self._call(self.nc.subscribe(prefix + ".>", cb=self._on_message))

    @property
    def public_key_b64(self) -> str:
        return b64e(bytes(self.x25519.public_key))

    async def _on_message(self, msg: Any) -> None:
        heard = Heard(msg.subject, msg.data, msg.reply or "")
        self.heard.append(heard)
        proof = heard.proof
        if proof is not None and proof[3].isdigit():
            self.newest[proof[1]] = max(self.newest.get(proof[1], 0), int(proof[3]))

    def _call(self, work: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    def messages(self) -> list[Heard]:
        return list(self.heard)

    def publish(self, subject: str, *payloads: bytes) -> None:
        async def go() -> None:
            for payload in payloads:
                await self.nc.publish(subject, payload)
            await self.nc.flush()
        self._call(go())

    def requests(self, subject: str, payloads: list[bytes], timeout: float = 1.0) -> list[bytes | None]:
        """Request/reply, all at once: each answer, or None when nobody answered."""
        async def one(payload: bytes) -> bytes | None:
            try:
                return bytes((await self.nc.request(subject, payload, timeout=timeout)).data)
            except Exception:  # noqa: BLE001 - timeout or no responders: no answer
                return None

        async def go() -> list[bytes | None]:
            return list(await asyncio.gather(*(one(p) for p in payloads)))
        return list(self._call(go()))

    def answer_claims(self, subject: str) -> list[bytes]:
        """Pose as a replica holding sessions: answer every claim on ``subject`` with ok."""
        claims: list[bytes] = []

        async def on_claim(msg: Any) -> None:
            claims.append(bytes(msg.data))
            if msg.reply:
                await self.nc.publish(msg.reply, messages.claim_reply(True))
        self._call(self.nc.subscribe(subject, cb=on_claim))
        return claims

    def refuse_claims(self, subject: str, holder: str, claimant: str) -> tuple[list[bytes], Callable[[], None]]:
        """Answer every claim on ``subject`` at once with garbage and, each of the ways ``forgeries`` knows,
        a refusal from ``holder`` to ``claimant``; the claims heard, and a function that stops answering."""
        claims: list[bytes] = []

        async def on_claim(msg: Any) -> None:
            claims.append(bytes(msg.data))
            if msg.reply:
                await self.nc.publish(msg.reply, b"\0garbage")
                for _, answer in self.forgeries(messages.claim_reply(False, "busy"), holder, claimant):
                    await self.nc.publish(msg.reply, answer)
                await self.nc.flush()
        subscription = self._call(self.nc.subscribe(subject, cb=on_claim))

        def stop() -> None:
            self._call(subscription.unsubscribe())
        return claims, stop

    def repeat(self, subject: str, make: Callable[[], list[bytes]], every: float = 0.05) -> Callable[[], None]:
        """Publish what ``make`` gives (fresh forgeries each time) every ``every`` s — more often than a
        replica re-announces — until stopped."""
        async def loop() -> None:
            while True:
                for payload in make():
                    await self.nc.publish(subject, payload)
                await asyncio.sleep(every)
        task = self._call(_start(loop()))

        def stop() -> None:
            self._loop.call_soon_threadsafe(task.cancel)
        return stop

    def seq(self, sender: str) -> int:
        """A sequence number the live ``sender`` has not used and soon will not (the attacker's best
        guess for a forgery to be taken as new): ahead of the newest it heard, within the window."""
        self._forged += 1
        return self.newest.get(sender, 0) + 8_000 + self._forged

    def forgeries(self, body: bytes, pose_as: str, to: str, *, live: bool = True) -> list[tuple[str, bytes]]:
        """``body`` as the attacker can send it, with the reason the receiving replica must drop each for:
        bare; posing as ``pose_as`` (a live replica or, not ``live``, one made up) with a random tag, at
        a fresh sequence number and at a huge one; posing as a replica that does not exist."""
        nobody = "inst_" + secrets.token_hex(8)
        posing = "bad_signature" if live else "unknown_replica"
        return [("unauthenticated", body),
                (posing, proof(pose_as, to, self.seq(pose_as)) + body),
                (posing, proof(pose_as, to, HUGE_SEQ) + body),
                ("unknown_replica", proof(nobody, to, 1) + body)]

    def wait(self, predicate: Callable[[Heard], bool], what: str, timeout: float = 20) -> Heard:
        return wait_until(lambda: next((h for h in self.messages() if predicate(h)), None), timeout=timeout,
                          interval=0.02, what=what)

    def close(self) -> None:
        try:
            self._call(self.nc.close(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


async def _start(work: Any) -> "asyncio.Task[None]":
    return asyncio.ensure_future(work)


HUGE_SEQ = 1 << 62  # a forgery with it, if accepted, would push its sender's replay window past every real message


def proof(sender: str, to: str, seq: int, *, ms: int | None = None) -> bytes:
    """A well-formed proof line with a random tag (64 bytes: a signature's length; 32: a MAC's)."""
    ms = int(time.time() * 1000) if ms is None else ms
    tag = encode_tag(secrets.token_bytes(64 if to == "*" else 32))
    return b"DBA1 %s %s %d %d %s\n" % (sender.encode(), to.encode(), seq, ms, tag)


def encode_tag(tag: bytes) -> bytes:
    """A tag as the replicas write it in their proof lines (the fixture checks it on the real ones)."""
    return base64.b64encode(tag)


def expected(*batches: list[tuple[str, bytes]]) -> Counter[str]:
    return Counter(reason for batch in batches for reason, _ in batch)


def payloads(*batches: list[tuple[str, bytes]]) -> list[bytes]:
    """What to publish, the window-pushing forgeries last (were one accepted, it would hide the rest)."""
    every = [payload for batch in batches for _, payload in batch]
    huge = b" %d " % HUGE_SEQ
    return [p for p in every if huge not in p[:MAX_PROOF]] + [p for p in every if huge in p[:MAX_PROOF]]


# --- the coordinator, seen from outside ---------------------------------------------------------------


DROPPED_LINE = re.compile(r'^darkbloom_fabric_dropped_total\{reason="([a-z_]+)"\} (\S+)$')


def dropped(coord: Coordinator) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in httpx.get(coord.base_url + "/metrics", timeout=10).text.splitlines():
        match = DROPPED_LINE.match(line)
        if match:
            counts[match[1]] = int(float(match[2]))
    return counts


def wait_dropped(coord: Coordinator, before: Counter[str], wanted: Counter[str], what: str) -> Counter[str]:
    """Until ``coord`` counts at least ``wanted`` more drops of each reason than ``before``."""
    def enough() -> Counter[str] | None:
        now = dropped(coord)
        delta = Counter({reason: now[reason] - before[reason] for reason in now})
        return delta if all(delta[reason] >= count for reason, count in wanted.items()) else None
    try:
        return wait_until(enough, timeout=15, interval=0.05, what=what)
    except AssertionError:
        now = dropped(coord)
        raise AssertionError(f"{what}: wanted {dict(wanted)} more, counted {dict(now - before)}") from None


def get(coord: Coordinator, path: str, token: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(coord.api_url + path, headers={"Authorization": f"Bearer {token}", **(headers or {})},
                     timeout=30)


def chat(coord: Coordinator, token: str, model: str = MODEL, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16}
    return httpx.post(coord.api_url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {token}", **(headers or {})})


def stream(coord: Coordinator, token: str, model: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", coord.api_url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {token}", **(headers or {})}) as response:
        return response.status_code, response.read().decode()


def events(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def content(text: str) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events(text) if e.get("choices"))


def machines(coord: Coordinator, account: Account) -> list[dict[str, Any]]:
    return list(get(coord, "/me/providers", account.session).json()["data"])


def listed(coord: Coordinator, account: Account, session_id: str) -> dict[str, Any] | None:
    return next((m for m in machines(coord, account) if m["online"] and m["session_id"] == session_id), None)


def balance(coord: Coordinator, account: Account) -> dict[str, int]:
    return dict(get(coord, "/payments/balance", account.api_key).json())


def usage_row(coord: Coordinator, account: Account, request_id: str) -> dict[str, Any]:
    def row() -> dict[str, Any] | None:
        rows = get(coord, "/payments/usage?limit=100", account.session).json()["data"]
        return next((r for r in rows if r["request_id"] == request_id), None)
    return dict(wait_until(row, timeout=20, what=f"the usage row of {request_id}"))


class Watch:
    """Samples ``check`` (None when all is well, else what is wrong) on a thread until stopped: what
    an attack broke for an instant, before the next heartbeat repaired it, is seen all the same."""

    def __init__(self, check: Callable[[], str | None], every: float = 0.05) -> None:
        self.problems: list[str] = []
        self.samples = 0
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                problem = check()
                self.samples += 1
                if problem is not None:
                    self.problems.append(problem)
                time.sleep(every)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(10)
        return self.problems


def rss_mb(coord: Coordinator) -> float:
    for line in Path(f"/proc/{coord.process.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def opens_with(key: PrivateKey, frame: dict[str, Any]) -> bool:
    """Whether a sealed request body opens with ``key`` (it was sealed to that key)."""
    envelope = frame["encrypted_body"]
    try:
        Box(key, PublicKey(b64d(envelope["ephemeral_public_key"]))).decrypt(b64d(envelope["ciphertext"]))
        return True
    except (CryptoError, ValueError):
        return False


# --- the world ----------------------------------------------------------------------------------------


@dataclass
class World:
    replicas: Replicas
    a: Coordinator
    b: Coordinator
    spy: Attacker
    victim: Account      # owns `honest`
    payer: Account       # pays for the positive controls
    honest: ThreadedRaw  # the victim's public machine on A
    node_owner: Account  # owns the real node
    node: Process        # a real `darkbloom serve` on A (bundled model, private-only)
    node_session: str
    node_home: Path
    a_id: str = ""
    b_id: str = ""
    raws: list[ThreadedRaw] = field(default_factory=list)

    def held_machine(self, **options: Any) -> tuple[ThreadedRaw, Account]:
        owner = create_account(self.b)
        raw = ThreadedRaw(self.a.base_url, device_token(self.a, owner), answer=None, models=(HELD,), **options)
        self.raws.append(raw)
        wait_until(lambda: listed(self.b, owner, raw.session_id), timeout=20, what="the held machine on B")
        return raw, owner

    def announced(self, session_id: str) -> tuple[str, dict[str, Any]]:
        """The replica announcing a session and its latest announcement, as the spy heard them."""
        for heard in reversed(self.spy.messages()):
            if heard.subject == f"{self.replicas.prefix}.fleet" and heard.sender:
                for session in json.loads(heard.body).get("sessions", []):
                    if session["id"] == session_id:
                        return heard.sender, session
        raise AssertionError(f"{session_id} never announced")

    def subject(self, *parts: str) -> str:
        return ".".join((self.replicas.prefix, *parts))


CATALOG = {"models": [{"id": MODEL, "input_price": 50_000, "output_price": 200_000, "max_output_tokens": 2048},
                      {"id": HELD, "input_price": 50_000, "output_price": 200_000, "max_output_tokens": 2048},
                      {"id": BAIT, "input_price": 50_000, "output_price": 200_000, "max_output_tokens": 2048}]}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("fabric-attacks")
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps(CATALOG))
    # --runtime-allow: the hand-driven machines report this process's runtime hash (read once), which
    # stays verified even should the tree change between the replicas' start and theirs
    with replica_set(root, 2, "--catalog", str(catalog), "--queue-max-wait", "3",
                     "--runtime-allow", runtime_hash()) as replicas:
        a, b = replicas.coordinators
        spy = Attacker(replicas.prefix)
        raws: list[ThreadedRaw] = []
        node: Process | None = None
        try:
            victim = create_account(b)
            honest = ThreadedRaw(a.base_url, device_token(a, victim), answer=HONEST_ANSWER)
            raws.append(honest)
            node_owner = create_account(b)
            home = node_home(root, "node", device_token(b, node_owner))
            node = start_serve(a, home, "--private-only", "--max-concurrency", "2")
            node_session = wait_registered(node)
            payer = create_account(b, credit_micro_usd=10_000_000)
            w = World(replicas, a, b, spy, victim, payer, honest, node_owner, node, node_session, home, raws=raws)
            wait_until(lambda: listed(b, victim, honest.session_id) and listed(b, node_owner, node_session),
                       timeout=60, what="A's machines listed on B")
            # what the attacker learns by listening: the replicas' ids, from the proof lines
            w.a_id = w.announced(honest.session_id)[0]
            assert w.announced(node_session)[0] == w.a_id
            w.b_id = spy.wait(lambda h: h.subject == w.subject("fleet") and h.sender not in (None, w.a_id),
                              "B's heartbeat").sender or ""
            # the forgeries are shaped as the real proof lines are: six fields, the tag encoded alike
            for heard in spy.messages()[:50]:
                if heard.proof:
                    version, _, to, seq, ms, tag = heard.proof
                    assert version == "DBA1" and int(seq) >= 0 and abs(int(ms) - time.time() * 1000) < 60_000
                    assert encode_tag(base64.b64decode(tag, validate=True)) == tag.encode(), heard.proof
                    assert len(base64.b64decode(tag)) == (64 if to == "*" else 32), heard.proof
            yield w
        finally:
            for raw in raws:
                raw.close()
            if node is not None:
                node.stop()
            spy.close()


# --- the positive controls ----------------------------------------------------------------------------


def assert_honest_path(w: World) -> None:
    """A paid request on B is served across NATS by the victim's machine on A and billed normally."""
    before = balance(w.b, w.payer)
    earned_before = get(w.b, "/provider/earnings?limit=100", w.victim.session).json()["total_micro_usd"]
    response = chat(w.b, w.payer.api_key)
    assert response.status_code == 200, response.text
    assert response.headers["x-provider-id"] == w.honest.session_id
    assert response.headers["x-darkbloom-routed"] == "fleet"
    assert response.headers["x-darkbloom-billing"] == "charged"
    assert response.json()["choices"][0]["message"]["content"] == HONEST_ANSWER
    request_id = response.headers["x-request-id"]
    assert request_id in w.honest.requests
    row = usage_row(w.b, w.payer, request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 1), row
    assert row["provider_id"] == w.honest.session_id and row["cost_micro_usd"] > 0, row
    assert balance(w.a, w.payer)["balance_micro_usd"] == before["balance_micro_usd"] - row["cost_micro_usd"]
    earned = wait_until(lambda: (e := get(w.b, "/provider/earnings?limit=100", w.victim.session).json())
                        and request_id in {x["request_id"] for x in e["data"]} and e, timeout=20,
                        what="the victim's earnings")
    assert earned["total_micro_usd"] > earned_before


def assert_node_serves(w: World) -> None:
    """The real node on A serves its owner's self-routed request on B."""
    response = chat(w.b, w.node_owner.api_key, headers=SELF)
    assert response.status_code == 200, response.text
    assert response.headers["x-provider-id"] == w.node_session
    assert response.json()["choices"][0]["message"]["content"]
    assert re.search(rf"request {re.escape(response.headers['x-request-id'])} accepted", w.node.log())


def assert_no_leak_to_attacker(w: World, fake_ids: list[str]) -> None:
    """No replica ever claimed, held or announced a fake session, nor sealed a request to the attacker."""
    for heard in w.spy.messages():
        for fake in fake_ids:
            assert fake.encode() not in heard.data, (heard.subject, heard.data[:300])
        if heard.subject.startswith(w.subject("hold")):
            header, payload = heard.hold()
            if header.get("k") == "request" and int(header.get("n", 1)) == 1:
                assert not opens_with(w.spy.x25519, json.loads(payload)), header


# --- the held request: a stream on B, on a hand-held machine on A --------------------------------------


@dataclass
class HeldRequest:
    raw: ThreadedRaw
    owner: Account
    request_id: str
    ticket: str
    header: dict[str, Any]
    frame: dict[str, Any]
    captured: Heard  # the hold message B sent, as the attacker heard it
    result: Any      # the client's (status, text), a Future


def hold_open(w: World, pool: ThreadPoolExecutor, raw: ThreadedRaw, owner: Account) -> HeldRequest:
    result = pool.submit(stream, w.b, owner.api_key, HELD, SELF)
    request_id = wait_until(lambda: next(iter(raw.requests), None), timeout=20, what="the request on A")
    captured = w.spy.wait(lambda h: h.subject == w.subject("hold", w.a_id) and h.hold()[0].get("r") == request_id
                          and h.hold()[0].get("k") == "request", "the hold message")
    header, payload = captured.hold()
    assert header["f"] == w.b_id and header["s"] == raw.session_id and int(header.get("n", 1)) == 1, header
    return HeldRequest(raw, owner, request_id, header["t"], header, json.loads(payload), captured, result)


def finish(held: HeldRequest, text: str = "the real words") -> str:
    held.raw.chunk(held.request_id, text)
    held.raw.complete(held.request_id, prompt_tokens=3, completion_tokens=2)
    status, body = held.result.result(60)
    assert status == 200, body
    assert body.rstrip().endswith("data: [DONE]"), body[-500:]
    assert not any("error" in e for e in events(body)), body
    return body


def fake_session(w: World, account_id: str, machine_id: str | None) -> dict[str, Any]:
    """A session as the attacker announces it: the honest one's shape, its own id and key, every
    advantage the scheduler could weigh, and the bait model besides."""
    _, honest = w.announced(w.honest.session_id)
    session = json.loads(json.dumps(honest))
    model = dict(session["models"][0])
    session.update(id="prov_" + secrets.token_hex(8), account_id=account_id, machine_id=machine_id,
                   public_key=w.spy.public_key_b64, models=[session["models"][0], {**model, "id": BAIT}],
                   active=0, max_concurrency=64, decode_tps=10_000.0, connected_age=0.0, challenge_age=0.0,
                   private_only=False, draining=False, untrusted_reason=None, name="evil")
    return session


def delta(replica: str, sessions: list[dict[str, Any]], gone: list[str]) -> bytes:
    """A fleet delta as a replica sends it (the attacker guesses a sequence number)."""
    return messages.deltas(replica, 1 + secrets.randbelow(1000), [messages.encoded(s) for s in sessions], gone,
                           MB)[0]


def announce_fakes(w: World, session: dict[str, Any], evil: str) -> list[tuple[str, bytes]]:
    """The fake session, announced as the attacker's own replica ``evil`` and as replica A."""
    as_evil = delta(evil, [session], [])
    as_a = delta(w.a_id, [session], [])
    return w.spy.forgeries(as_evil, evil, "*", live=False) + w.spy.forgeries(as_a, w.a_id, "*")


# --- the rows -----------------------------------------------------------------------------------------


def test_fake_session_on_the_victims_machine_gets_none_of_its_requests(world: World) -> None:
    w = world
    _, honest = w.announced(w.honest.session_id)
    fake = fake_session(w, w.victim.account_id, honest["machine_id"])
    evil = "inst_" + secrets.token_hex(8)  # the attacker's replica: it answers the claims on its sessions
    batch = announce_fakes(w, fake, evil)
    claims = w.spy.answer_claims(w.subject("claim", evil))
    before_b, before_a = dropped(w.b), dropped(w.a)
    stop = w.spy.repeat(w.subject("fleet"), lambda: payloads(announce_fakes(w, fake, evil)))
    try:
        wait_dropped(w.b, before_b, expected(batch), "B dropping the fake announcements")
        for _ in range(4):
            response = chat(w.b, w.victim.api_key, headers=SELF)
            assert response.status_code == 200, response.text
            assert response.headers["x-provider-id"] == w.honest.session_id
            assert response.json()["choices"][0]["message"]["content"] == HONEST_ANSWER
            assert all(m["session_id"] != fake["id"] for m in machines(w.b, w.victim))
        # only the fake session serves the bait: the victim's request for it is a Self-Route error
        bait = chat(w.b, w.victim.api_key, BAIT, SELF)
        assert bait.status_code == 503 and bait.json()["error"]["code"] == "model_not_loaded", bait.text
        assert get(w.b, "/me/self-route-models", w.victim.api_key).json() == {"models": [MODEL]}
        assert all(m["session_id"] != fake["id"] for m in machines(w.b, w.victim) + machines(w.a, w.victim))
    finally:
        stop()
    assert not claims, claims
    assert not [h for h in w.spy.messages() if h.subject == w.subject("hold", evil)]
    assert_no_leak_to_attacker(w, [fake["id"]])
    delta_a = dropped(w.a) - before_a
    assert delta_a["unauthenticated"] and delta_a["unknown_replica"], delta_a  # (posing as A: own_message there)
    assert_honest_path(w)


def test_fake_session_on_the_attackers_account_earns_nothing(world: World) -> None:
    w = world
    attacker = create_account(w.b)
    fake = fake_session(w, attacker.account_id, "mach_" + secrets.token_hex(8))
    evil = "inst_" + secrets.token_hex(8)  # the attacker's replica: it answers the claims on its sessions
    batch = announce_fakes(w, fake, evil)
    claims = w.spy.answer_claims(w.subject("claim", evil))
    pockets = balance(w.b, attacker)
    before_b = dropped(w.b)
    stop = w.spy.repeat(w.subject("fleet"), lambda: payloads(announce_fakes(w, fake, evil)))
    try:
        wait_dropped(w.b, before_b, expected(batch), "B dropping the fake announcements")
        for _ in range(4):
            response = chat(w.b, w.payer.api_key)
            assert response.status_code == 200, response.text
            assert response.headers["x-provider-id"] == w.honest.session_id
        assert BAIT not in {m["id"] for m in get(w.b, "/models", w.payer.api_key).json()["data"]}
        bait = chat(w.b, w.payer.api_key, BAIT)
        assert bait.status_code >= 400 and "x-provider-id" not in bait.headers, bait.text
    finally:
        stop()
    assert not claims, claims
    assert_no_leak_to_attacker(w, [fake["id"]])
    assert balance(w.b, attacker) == pockets
    assert get(w.b, "/provider/earnings?limit=100", attacker.session).json()["data"] == []
    assert not table(w.replicas.database_url, usage_records, usage_records.c.provider_id == fake["id"])
    assert_honest_path(w)


def test_injected_chunks_and_completion_never_reach_the_consumer(world: World) -> None:
    w = world
    raw, owner = w.held_machine()
    with ThreadPoolExecutor(1) as pool:
        held = hold_open(w, pool, raw, owner)
        ephemeral = held.frame["encrypted_body"]["ephemeral_public_key"]
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": HELD,
                 "choices": [{"index": 0, "delta": {"content": INJECTED}, "finish_reason": None}]}
        sealed = [Sealer.to(ephemeral).seal(json.dumps(chunk).encode()),
                  Sealer.between(w.spy.x25519, ephemeral).seal(json.dumps(chunk).encode())]
        bodies = [b'{"k":"chunk","e":' + envelope.model_dump_json().encode() + b"}" for envelope in sealed]
        bodies += [json.dumps({"k": "complete", "usage": {"prompt_tokens": 7, "completion_tokens": 9},
                               "account_id": None}).encode(),
                   messages.back_error(500, INJECTED, None, None), messages.back_gone(), messages.back_gone("busy")]
        batch = [item for body in bodies for item in w.spy.forgeries(body, w.a_id, w.b_id)]
        before = dropped(w.b)
        w.spy.publish(w.subject("back", w.b_id, held.ticket), *payloads(batch))
        wait_dropped(w.b, before, expected(batch), "B dropping the injected back messages")
        body = finish(held)
    assert content(body) == "the real words", body
    assert INJECTED not in body
    row = usage_row(w.b, owner, held.request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 2), row
    assert row["provider_id"] == raw.session_id and not row.get("ownership_changed"), row
    machine = listed(w.b, owner, raw.session_id)
    assert machine is not None and machine["trust_level"] != "untrusted", machine
    raw.close()
    assert_honest_path(w)


def test_replayed_messages_are_dropped(world: World) -> None:
    w = world
    raw, owner = w.held_machine()
    with ThreadPoolExecutor(1) as pool:
        held = hold_open(w, pool, raw, owner)
        before_b = dropped(w.b)
        raw.chunk(held.request_id, "once-only ")
        original = w.spy.wait(lambda h: h.subject == w.subject("back", w.b_id, held.ticket)
                              and b'"k":"chunk"' in h.body, "A's chunk on its way to B")
        assert original.sender == w.a_id
        announcement = next(h for h in reversed(w.spy.messages())
                            if h.subject == w.subject("fleet") and h.sender == w.a_id)
        w.spy.publish(original.subject, original.data, original.data, original.data)
        w.spy.publish(announcement.subject, announcement.data)
        wait_dropped(w.b, before_b, Counter(replayed=4), "B dropping the replayed chunk and announcement")
        body = finish(held, "and the rest")
    assert content(body) == "once-only and the rest", body
    assert content(body).count("once-only") == 1
    assert (usage_row(w.b, owner, held.request_id)["completion_tokens"]) == 2
    raw.close()
    assert_honest_path(w)


def test_request_on_the_holder_gets_no_free_inference(world: World) -> None:
    w = world
    batch: list[tuple[str, bytes]] = []
    ids: list[tuple[str, str]] = []
    for session_id in (w.honest.session_id, w.node_session):
        _, announced = w.announced(session_id)
        key = public_key_from_b64(announced["public_key"])
        request_id, ticket = "req_" + secrets.token_hex(12), secrets.token_hex(8)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Free inference, please."}],
                "max_tokens": 16, "stream": True}
        frame = dump(InferenceRequest(request_id=request_id,
                                      encrypted_body=ReplyKey().seal_request(json.dumps(body).encode(), key)))
        for admitter in (w.b_id, "inst_" + secrets.token_hex(8)):
            message = messages.hold_message("request", frame.encode(), t=ticket, s=session_id, r=request_id,
                                            f=admitter, p=0, n=1)
            batch += w.spy.forgeries(message, w.b_id, w.a_id)
        ids.append((request_id, ticket))
    before = dropped(w.a)
    w.spy.publish(w.subject("hold", w.a_id), *payloads(batch))
    wait_dropped(w.a, before, expected(batch), "A dropping the forged requests")
    assert_honest_path(w)  # the honest traffic after them is through A's socket reader too
    assert_node_serves(w)
    for request_id, ticket in ids:
        assert request_id not in w.honest.requests
        assert request_id not in w.node.log()
        assert not [h for h in w.spy.messages() if h.subject.endswith("." + ticket)]
        assert not table(w.replicas.database_url, usage_records, usage_records.c.request_id == request_id)


def test_request_reusing_a_live_request_id(world: World) -> None:
    w = world
    raw, owner = w.held_machine()
    with ThreadPoolExecutor(1) as pool:
        held = hold_open(w, pool, raw, owner)
        original = raw.frames[held.request_id]
        key = public_key_from_b64(w.announced(raw.session_id)[1]["public_key"])
        body = {"model": HELD, "messages": [{"role": "user", "content": "Answer me instead."}], "max_tokens": 16}
        frame = dump(InferenceRequest(request_id=held.request_id,
                                      encrypted_body=ReplyKey().seal_request(json.dumps(body).encode(), key)))
        batch: list[tuple[str, bytes]] = []
        for ticket in (held.ticket, secrets.token_hex(8)):
            message = messages.hold_message("request", frame.encode(), t=ticket, s=raw.session_id,
                                            r=held.request_id, f=w.b_id, p=0, n=1)
            batch += w.spy.forgeries(message, w.b_id, w.a_id)
        before = dropped(w.a)
        w.spy.publish(w.subject("hold", w.a_id), *payloads(batch), held.captured.data)
        wait_dropped(w.a, before, expected(batch) + Counter(replayed=1), "A dropping the reused request id")
        assert raw.frames[held.request_id] is original and list(raw.requests) == [held.request_id]
        assert raw.cancels == []
        body = finish(held)
    assert content(body) == "the real words", body
    row = usage_row(w.b, owner, held.request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 2), row
    raw.close()
    assert_honest_path(w)


def test_control_messages_cannot_disrupt_the_holder(world: World) -> None:
    w = world
    raw, owner = w.held_machine()
    honest, node = w.honest.session_id, w.node_session
    baseline = rss_mb(w.a)
    trust_before = w.honest.provider.trust_statuses[:]
    with ThreadPoolExecutor(2) as pool:
        held = hold_open(w, pool, raw, owner)
        fleet = [messages.leaving(w.a_id), messages.alive(w.a_id, 1 << 40, 0),
                 delta(w.a_id, [], [honest, node, raw.session_id])]
        fleet_batch = [item for body in fleet for item in w.spy.forgeries(body, w.a_id, "*")]
        # to B alone: an empty full view of A's, and asks for B's view (each would cost B a full view)
        views = [messages.view(w.a_id, 1 << 40, 1, [], MB)[0], messages.sync_request(w.a_id)]
        view_batch = [item for body in views for item in w.spy.forgeries(body, w.a_id, w.b_id)]
        untrusted = dump(TrustStatus(trust_level="untrusted", reason="the attacker says so"))
        sessions = (honest, node, raw.session_id)
        cancel = json.dumps({"type": "cancel", "request_id": held.request_id}).encode()
        holds = [messages.hold_message("frame", untrusted.encode(), s=s, f=w.b_id) for s in sessions]
        holds += [messages.hold_message("unlink", s=s) for s in sessions]
        holds += [messages.hold_message("speed", s=s, tps=0.0) for s in sessions]
        holds += [messages.hold_message("release", t=held.ticket),
                  messages.hold_message("frame", cancel, t=held.ticket, s=raw.session_id, f=w.b_id)]
        hold_batch = [item for body in holds for item in w.spy.forgeries(body, w.b_id, w.a_id)]
        complete = json.dumps({"k": "complete", "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                               "account_id": None}).encode()
        back_batch = w.spy.forgeries(complete, w.a_id, w.b_id)
        claims = [messages.claim_request(s, secrets.token_hex(8), w.b_id) for s in (honest, honest, node)]
        claim_batch = [item for body in claims for item in w.spy.forgeries(body, w.b_id, w.a_id)]
        before_a, before_b = dropped(w.a), dropped(w.b)

        def b_sees_a() -> str | None:
            ready = readyz(w.b)
            if ready.get("replicas") != 2:
                return f"B hears {ready.get('replicas')} replicas"
            for account, session_id in ((w.victim, honest), (owner, raw.session_id)):
                machine = listed(w.b, account, session_id)
                if machine is None or machine["trust_level"] == "untrusted":
                    return f"B lists {session_id} as {machine}"
            return None
        watch = Watch(b_sees_a)
        w.spy.publish(w.subject("fleet"), *payloads(fleet_batch))
        w.spy.publish(w.subject("view", w.b_id), *payloads(view_batch))
        w.spy.publish(w.subject("hold", w.a_id), *payloads(hold_batch))
        w.spy.publish(w.subject("back", w.b_id, held.ticket), *payloads(back_batch))
        answers = w.spy.requests(w.subject("claim", w.a_id), payloads(claim_batch))
        assert answers == [None] * len(claim_batch), answers

        # 200 first parts of 1 MB of split request frames (12 parts each), half of them with a proof line
        peak = [baseline]
        flooding = threading.Event()

        def sample() -> None:
            while flooding.is_set():
                peak[0] = max(peak[0], rss_mb(w.a))
                time.sleep(0.02)
        flood: list[tuple[str, bytes]] = []
        for index in range(200):
            part = messages.hold_message("request", b"\0" * MB, t=secrets.token_hex(8), s=honest,
                                         r="req_" + secrets.token_hex(12), f=w.b_id, p=0, n=12)
            flood.append(("unauthenticated", part) if index % 2 else
                         ("bad_signature", proof(w.b_id, w.a_id, w.spy.seq(w.b_id)) + part))
        flooding.set()
        sampler = pool.submit(sample)
        try:
            for start in range(0, len(flood), 20):
                w.spy.publish(w.subject("hold", w.a_id), *payloads(flood[start:start + 20]))
            # (the announcements posing as A are A's own_message there, counted at B as bad_signature)
            at_a = expected(hold_batch, claim_batch, flood) + expected(fleet_batch) - Counter(
                bad_signature=expected(fleet_batch)["bad_signature"])
            wait_dropped(w.a, before_a, at_a, "A dropping the control messages and the flood")
        finally:
            flooding.clear()
            sampler.result(10)
        del flood
        wait_dropped(w.b, before_b, expected(fleet_batch, view_batch, back_batch),
                     "B dropping the announcements, the views and the completion")
        after = rss_mb(w.a)
        problems = watch.stop()
        assert watch.samples >= 3 and not problems, (watch.samples, problems[:5])

        # nothing changed: A is still heard, its machines listed on B, trusted, owned, connected and free
        assert readyz(w.b)["replicas"] == 2 and readyz(w.a)["replicas"] == 2
        for coord in (w.a, w.b):
            for account, session_id in ((w.victim, honest), (w.node_owner, node), (owner, raw.session_id)):
                machine = listed(coord, account, session_id)
                assert machine is not None, (coord.base_url, session_id)
                assert machine["trust_level"] != "untrusted", machine
        assert raw.cancels == [] and list(raw.requests) == [held.request_id]
        assert w.honest.provider.trust_statuses == trust_before
        assert w.honest._thread.is_alive() and raw._thread.is_alive() and w.node.proc.poll() is None
        assert w.announced(honest)[1]["active"] == 0
        body = finish(held)
    assert content(body) == "the real words", body
    row = usage_row(w.b, owner, held.request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 2) and not row.get("ownership_changed"), row
    print(f"A's RSS: {baseline:.0f} MB before the flood, peak {peak[0]:.0f} MB, {after:.0f} MB after")
    assert after - baseline < 50, f"A's RSS grew from {baseline:.0f} MB to {after:.0f} MB (peak {peak[0]:.0f} MB)"
    assert peak[0] - baseline < 100, f"A's RSS peaked at {peak[0]:.0f} MB from {baseline:.0f} MB"
    raw.close()
    assert_honest_path(w)
    assert_node_serves(w)


def test_trust_status_with_a_junk_certificate_is_written_nowhere(world: World) -> None:
    w = world
    junk = dump(TrustStatus(trust_level="hardware", reason="enrolled",
                            certificate="-----BEGIN CERTIFICATE-----\nanVuaw==\n-----END CERTIFICATE-----\n"))
    batch: list[tuple[str, bytes]] = []
    for session_id in (w.honest.session_id, w.node_session):
        batch += w.spy.forgeries(messages.hold_message("request", junk.encode(), t=secrets.token_hex(8), s=session_id,
                                                 r="req_" + secrets.token_hex(12), f=w.b_id, p=0, n=1),
                           w.b_id, w.a_id)
        batch += w.spy.forgeries(messages.hold_message("frame", junk.encode(), s=session_id, f=w.b_id), w.b_id, w.a_id)
    trust_before = w.honest.provider.trust_statuses[:]
    before = dropped(w.a)
    w.spy.publish(w.subject("hold", w.a_id), *payloads(batch))
    wait_dropped(w.a, before, expected(batch), "A dropping the trust statuses")
    assert_honest_path(w)
    assert_node_serves(w)  # frames written after the attack's reached the node: so would the attack's
    assert w.honest.provider.trust_statuses == trust_before
    assert not (w.node_home / "certificate.pem").exists()
    assert "trust level now" not in w.node.log()
    for account, session_id in ((w.victim, w.honest.session_id), (w.node_owner, w.node_session)):
        machine = listed(w.b, account, session_id)
        assert machine is not None and machine["trust_level"] != "hardware", machine


def test_forged_proof_lines_are_counted_as_such(world: World) -> None:
    """A well-formed proof line with a random signature or MAC, as a live replica or as none."""
    w = world
    heartbeat = messages.alive(w.a_id, 0, 0)
    nobody = "inst_" + secrets.token_hex(8)
    to_b = [proof(w.a_id, "*", w.spy.seq(w.a_id)) + heartbeat, proof(nobody, "*", 1) + heartbeat]
    back = messages.back_gone()
    to_b_back = [proof(w.a_id, w.b_id, w.spy.seq(w.a_id)) + back, proof(nobody, w.b_id, 1) + back]
    before = dropped(w.b)
    w.spy.publish(w.subject("fleet"), *to_b)
    w.spy.publish(w.subject("back", w.b_id, secrets.token_hex(8)), *to_b_back)
    delta = wait_dropped(w.b, before, Counter(bad_signature=2, unknown_replica=2), "B counting the forgeries")
    assert delta["bad_signature"] == 2 and delta["unknown_replica"] == 2, delta
    assert_honest_path(w)


def test_forged_answers_to_claims_are_waited_past(world: World) -> None:
    w = world
    raw, owner = w.held_machine(max_concurrency=2)
    claims, stop = w.spy.refuse_claims(w.subject("claim", w.a_id), w.a_id, w.b_id)
    before, logged = dropped(w.b), len(w.b.process.log())
    try:
        with ThreadPoolExecutor(2) as pool:
            held = hold_open(w, pool, raw, owner)  # one of the machine's two slots, busy throughout
            for n in range(6):
                result = pool.submit(stream, w.b, owner.api_key, HELD, SELF)
                request_id = wait_until(lambda: raw.requests[n + 1] if len(raw.requests) > n + 1 else None,
                                        timeout=20, what=f"request {n} on A")
                raw.chunk(request_id, f"answer {n}")
                raw.complete(request_id)
                status, body = result.result(60)
                assert status == 200 and content(body) == f"answer {n}", (n, body[-300:])
            body = finish(held)
            assert content(body) == "the real words", body
        assert_honest_path(w)  # a paid request's claim, under the same answers
        assert len(claims) >= 8, len(claims)
        refused = [line for line in w.b.process.log()[logged:].splitlines() if "refused a slot" in line]
        assert not refused, refused  # every claim was A's to answer, and A had a free slot
        # (an answer that comes after A's is not even read: only those that came first are counted)
        wait_dropped(w.b, before, Counter(unauthenticated=2, bad_signature=2, unknown_replica=1),
                     "B dropping forged answers")
    finally:
        stop()
    counted = dropped(w.b) - before
    assert counted["replayed"] == 0, counted
    print(f"{len(claims)} claims on A; forged answers read and dropped on B: {dict(counted)}")
    wait_until(lambda: w.announced(raw.session_id)[1]["active"] == 0, timeout=10, what="A freeing every slot")
    raw.close()
