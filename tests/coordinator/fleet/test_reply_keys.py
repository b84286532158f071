"""A request's reply key (docs/protocol.md "Sealing"): fresh for every request to a node, its key
agreement with the node's key made ahead — once the loop has run what was ready when a request's
frame was queued, the frame's write among it — so a dispatch at one request at a time does not wait
for it; nothing is made ahead for a session that has gone offline."""

from __future__ import annotations

import asyncio

import pytest
from nacl.public import Box

from darkbloom.wire import crypto
from darkbloom.wire.crypto import Sealer, b64e, open_envelope
from tests.coordinator.routing.sim import SimProvider


@pytest.fixture
def agreements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many key agreements (``Box`` made from two keys) the code under test has made."""
    made = [0]

    def counted(private: object, public: object) -> Box:
        made[0] += 1
        return Box(private, public)  # type: ignore[arg-type]

    monkeypatch.setattr(crypto, "Box", counted)
    return made


async def test_every_request_gets_a_fresh_key_whose_agreement_was_made_ahead(agreements: list[int]) -> None:
    provider = SimProvider()
    session = provider.session
    assert session.public_key is not None
    session.reply_key()  # the first request to the node: made now
    keys = set()
    for _ in range(5):
        session.prepare_reply_key()  # as a dispatch does once its frame is queued
        await asyncio.sleep(0)  # the loop runs what was ready: the next key is made then
        made = agreements[0]
        key = session.reply_key()
        envelope = key.seal_request(b'{"messages": []}', session.public_key)
        assert agreements[0] == made, "sealing the request made its key agreement on the dispatch's path"
        keys.add(envelope.ephemeral_public_key)
        # the node opens it with its own key, and its reply opens with the request's key
        assert open_envelope(envelope, provider.identity.encryption_key) == b'{"messages": []}'
        reply = Sealer.between(provider.identity.encryption_key, envelope.ephemeral_public_key).seal(b"chunk")
        assert key.open(reply) == b"chunk"
    assert len(keys) == 5, "a reply key was used for two requests"


async def test_a_key_sealed_to_another_recipient_makes_its_own_agreement(agreements: list[int]) -> None:
    provider, other = SimProvider(), SimProvider()
    key = provider.session.reply_key()
    assert other.session.public_key is not None
    made = agreements[0]
    envelope = key.seal_request(b"{}", other.session.public_key)
    assert agreements[0] == made + 1
    assert open_envelope(envelope, other.identity.encryption_key) == b"{}"
    assert envelope.ephemeral_public_key == b64e(bytes(key.public_key))


async def test_nothing_is_made_ahead_for_a_session_gone_offline(agreements: list[int]) -> None:
    provider = SimProvider()
    provider.session.reply_key()
    provider.session.prepare_reply_key()
    provider.session.unlisted()  # taken out of the registry: offline
    made = agreements[0]
    await asyncio.sleep(0)
    assert agreements[0] == made
