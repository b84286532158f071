"""What authenticating the fabric costs (docs/replicas.md, "Authentication"): CPU per message to seal
(sender) and open (receiver) each kind of fabric message, and per cross-replica request — the
messages one non-streamed or streamed request exchanges between the admitting replica and the
holder: the claim and its answer, the sealed request, the node's chunk frames, the completion and
the release, plus (on the admitting side) opening each chunk from the node's key instead of from
the envelope's own key.

Both replicas' keys live in a throwaway SQLite database, as they would in Postgres; the figures are
pure CPU (no NATS, no network). Run: .venv/bin/python bench/fabric_auth.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

from sqlalchemy import insert

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.authentication import Authenticator, ReplicaKey, Roster
from darkbloom.store import create_engine, migrate
from darkbloom.store.schema import coordinator_instances
from darkbloom.wire.crypto import NodeIdentity, ReplyKey, Sealer
from darkbloom.wire.protocol import InferenceRequest, Usage, dump

CHUNK = json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "word"}, "finish_reason": None}]}).encode()


async def two_replicas(root: Path) -> tuple[Authenticator, Authenticator]:
    engine = create_engine(f"sqlite+aiosqlite:///{root / 'bench.db'}")
    await migrate(engine)
    now = int(time.time())
    auths = []
    for name in ("inst_admitter", "inst_holder"):
        async with engine.begin() as conn:
            await conn.execute(insert(coordinator_instances).values(id=name, started_at=now, last_seen=now))
        roster = Roster(ReplicaKey(name), engine, stale_after=3600)
        await roster.publish()
        auths.append(Authenticator(roster))
    for auth in auths:
        await auth.roster.refresh()
    await engine.dispose()
    return auths[0], auths[1]


def per_call(work: Callable[[], object], rounds: int) -> float:
    """µs per call, the best of three batches (the machine is shared)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(rounds):
            work()
        best = min(best, (time.perf_counter() - start) / rounds)
    return best * 1e6


def finished(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine that never waits (opening a message from a known peer does no I/O)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("opening a message waited")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--chunks", type=int, default=16, help="chunk frames of the streamed request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        admitter, holder = asyncio.run(two_replicas(Path(tmp)))
    node = NodeIdentity.generate()
    reply = ReplyKey()
    request = dump(InferenceRequest(request_id="req_1", encrypted_body=reply.seal_request(
        b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 400 + b'"}]}', node.encryption_key.public_key)))
    chunk_from_node = Sealer.between(node.encryption_key, _b64(reply)).seal(CHUNK)
    bodies = {
        "announcement (1 session)": (admitter, holder, "p.fleet", json.dumps(
            {"replica": "inst_admitter", "full": True, "gone": [], "sessions": [{"id": "prov_" + "0" * 24,
             "models": [{"id": "m"}], "public_key": "k" * 44, "active": 0}]}).encode(), "*"),
        "claim": (admitter, holder, "p.claim.inst_holder",
                  messages.claim_request("prov_1", "t" * 16, "inst_admitter"), "inst_holder"),
        "claim answer": (holder, admitter, "_INBOX.x.y", messages.claim_reply(True), "inst_admitter"),
        "request (~0.6 kB)": (admitter, holder, "p.hold.inst_holder", messages.hold_message(
            "request", request.encode(), t="t" * 16, s="prov_1", r="req_1", f="inst_admitter"), "inst_holder"),
        "chunk": (holder, admitter, "p.back.inst_admitter." + "t" * 16, messages.back_chunk(chunk_from_node),
                  "inst_admitter"),
        "complete": (holder, admitter, "p.back.inst_admitter." + "t" * 16,
                     messages.back_complete(Usage(prompt_tokens=10, completion_tokens=16), "acct_1"), "inst_admitter"),
        "release": (admitter, holder, "p.hold.inst_holder", messages.hold_message("release", t="t" * 16),
                    "inst_holder"),
    }
    rows: dict[str, tuple[float, float]] = {}
    for name, (sender, receiver, subject, body, to) in bodies.items():
        sealed = sender.seal(subject, body, to)
        assert sealed is not None

        def seal_once() -> None:
            sender.seal(subject, body, to)

        def open_once() -> None:
            receiver._windows.clear()  # the same message each time: measure the checks, not the replay drop
            finished(receiver.open(subject, sealed))

        rows[name] = (per_call(seal_once, args.rounds), per_call(open_once, args.rounds))

    anonymous = ReplyKey()
    fresh_chunk = Sealer(anonymous.public_key).seal(CHUNK)
    proven = ReplyKey(node.public_key_b64)
    proven_chunk = Sealer.between(node.encryption_key, _b64(proven)).seal(CHUNK)
    open_fresh = per_call(lambda: anonymous.open(fresh_chunk), args.rounds)
    open_proven = per_call(lambda: proven.open(proven_chunk), args.rounds)

    def request_cost(chunks: int) -> float:
        kinds = ["claim", "claim answer", "request (~0.6 kB)", "complete", "release"]
        return sum(sum(rows[k]) for k in kinds) + chunks * sum(rows["chunk"])

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# bench/fabric_auth.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.machine()}, {platform.python_version()}, commit {commit}, best of 3 × {args.rounds}")
    print()
    print("| message | seal µs (sender) | open µs (receiver) |")
    print("|---|---|---|")
    for name, (seal_us, open_us) in rows.items():
        print(f"| {name} | {seal_us:.1f} | {open_us:.1f} |")
    print()
    print("| per cross-replica request | µs of CPU, both replicas |")
    print("|---|---|")
    print(f"| non-streamed (claim, answer, request, 1 chunk frame, complete, release) | {request_cost(1):.0f} |")
    print(f"| streamed, {args.chunks} chunk frames | {request_cost(args.chunks):.0f} |")
    print(f"| opening a chunk: from a fresh key (before) / from the node's key (now) | "
          f"{open_fresh:.1f} / {open_proven:.1f} |")


def _b64(reply: ReplyKey) -> str:
    return base64.b64encode(bytes(reply.public_key)).decode()


if __name__ == "__main__":
    main()
