"""Conversation affinity: a conversation's next turn goes back to the provider session that served
its last one, whose node may still hold that prompt in its KV cache and reuse it (the answer's
``cached_tokens``).

The coordinator reads every request's body to route it (a body the consumer sealed is opened first:
``http/sealed_body.py``), so it can tell that a request's leading messages are an earlier request's
messages. ``Affinity`` remembers, for the last ``CAPACITY`` requests this replica served, a digest of
the request's messages (the conversation as it stood) → the session that served it. A new request
looks up the digests of its prefixes — its first message, its first two, …, all of them — longest
first: the session of the longest one known is its ``RouteDecision.affinity``. That is a preference,
never a gate: the scheduler takes it only over a session it would have chosen from the same view,
when it is free, passes every gate and still has the model loaded (``scheduler.select``).

A legacy completions prompt (one string) is a conversation of ``BLOCK_CHARS``-character blocks (the
full ones: the last, partial block is where the next request differs). Embeddings and batches of
prompts have none.

The digests are HMAC-SHA256 under a key drawn when the process starts, over the caller's account, the
model and each part: useless outside this process, and never the same for two accounts (nobody can
learn, from the ``X-Provider-Id`` their request gets, that another account sent a conversation).
They stay in this object: never logged, sent to another replica or stored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections import OrderedDict
from typing import Any, Iterator

import orjson

from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.wire.protocol import Api

CAPACITY = 10_000  # conversations remembered (least recently used forgotten first)
BLOCK_CHARS = 512  # a completions prompt's part
MAX_PARTS = 1_024  # parts of a request looked at: beyond, its prefixes are all alike
_DIGEST_BYTES = 16


class Conversation:
    """A request's prefixes as digests, shortest first. Opaque: it prints no digest."""

    __slots__ = ("prefixes",)

    def __init__(self, prefixes: tuple[bytes, ...] = ()) -> None:
        self.prefixes = prefixes

    def __repr__(self) -> str:
        return f"<Conversation of {len(self.prefixes)} parts>"


class Affinity:
    """Conversation digests → the session id that served each, in least-recently-used order, at most
    ``capacity`` of them; one per process (``Services.affinity``)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._key = secrets.token_bytes(32)
        self._served: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._served)

    def conversation(self, account_id: str, model_id: str, api: Api, body: dict[str, Any]) -> Conversation:
        """The digests of the prefixes of ``body`` (what a node receives for ``api``), for this account
        and model."""
        running = hmac.new(self._key, digestmod=hashlib.sha256)
        for label in (account_id, model_id):
            _add(running, label.encode())
        prefixes = []
        for part in _parts(api, body):
            _add(running, part)
            prefixes.append(running.copy().digest()[:_DIGEST_BYTES])
        return Conversation(tuple(prefixes))

    def recall(self, conversation: Conversation) -> str | None:
        """The session that served the longest known prefix of the conversation, if any."""
        for digest in reversed(conversation.prefixes):
            session_id = self._served.get(digest)
            if session_id is not None:
                self._served.move_to_end(digest)
                return session_id
        return None

    def remember(self, conversation: Conversation, session_id: str) -> None:
        """The session serving the conversation, for its next turn."""
        if not conversation.prefixes:
            return
        whole = conversation.prefixes[-1]
        self._served[whole] = session_id
        self._served.move_to_end(whole)
        while len(self._served) > self.capacity:
            self._served.popitem(last=False)


def _add(running: hmac.HMAC, part: bytes) -> None:
    running.update(len(part).to_bytes(8, "big"))
    running.update(part)


def _parts(api: Api, body: dict[str, Any]) -> Iterator[bytes]:
    if api == "chat":
        messages = body.get("messages")
        for message in messages[:MAX_PARTS] if isinstance(messages, list) else ():
            yield _canonical(message)
    elif api == "completions":
        prompts = completion_prompts(body)
        if len(prompts) == 1 and isinstance(prompts[0], str):
            text = prompts[0]
            for start in range(0, min(len(text) // BLOCK_CHARS, MAX_PARTS) * BLOCK_CHARS, BLOCK_CHARS):
                yield text[start:start + BLOCK_CHARS].encode("utf-8", "surrogatepass")


def _canonical(message: Any) -> bytes:
    """One message as JSON with its keys sorted: the same message however a client orders its fields."""
    try:
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # what orjson refuses (integers past 64 bits, lone surrogates)
        return json.dumps(message, sort_keys=True, separators=(",", ":")).encode()
