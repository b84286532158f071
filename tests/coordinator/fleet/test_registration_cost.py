"""A registration costs the same with 10 sessions registered as with 1,000: the same SQL statements
and the same Python calls into darkbloom (anything that walked the fleet would add calls per
session), for a node registering through the real path (``ProviderConnection.open``, the first challenge,
``complete_registration``) and for its disconnection. Work is counted, never timed."""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections import Counter
from types import FrameType
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fleet.connection import ProviderConnection
from darkbloom.coordinator.fleet.enrollment import load_or_create_ca
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.store import accounts, devices, machines
from darkbloom.wire.crypto import NodeIdentity, challenge_message, token_hash
from darkbloom.wire.protocol import (
    AttestationChallenge,
    AttestationResponse,
    ModelInfo,
    Register,
    Registered,
    parse_coordinator_frame,
)
from tests.coordinator.fleet.test_machine_book import count, services_on
from tests.coordinator.routing.sim import RUNTIME, SimProvider

MODEL = "fleet-model"


async def linked_token(engine: AsyncEngine, account_id: str) -> str:
    token = "dkp-" + secrets.token_urlsafe(24)
    async with engine.begin() as conn:
        machine_id = await machines.create(conn, account_id, name="node")
        await devices.create_token(conn, token_hash(token), machine_id, account_id)
    return token


async def register(services: Any, token: str, identity: NodeIdentity,
                   certificate: str | None = None) -> tuple[ProviderConnection, ProviderSession, asyncio.Task[None]]:
    """One node's registration, as its connection drives it (its socket never read: the node's side is
    answered from here)."""
    frame = Register(auth_token=token, models=[ModelInfo(id=MODEL)], backend="test", version="test",
                     runtime_hash=RUNTIME, public_key=identity.public_key_b64,
                     identity_key=identity.identity_key_b64, attestation=identity.attestation(RUNTIME),
                     certificate=certificate)
    connection = ProviderConnection(services, websocket=None)  # type: ignore[arg-type]
    session = await connection.open(frame, time.monotonic())
    registering = services.registrations.enter()
    trust = asyncio.create_task(connection.keep_trust(registering))
    challenge = parse_coordinator_frame(await connection.outbox.get())
    assert isinstance(challenge, AttestationChallenge)
    signature = identity.sign(challenge_message(challenge.nonce, challenge.timestamp, RUNTIME))
    connection.answer(AttestationResponse(nonce=challenge.nonce, signature=signature, runtime_hash=RUNTIME))
    assert isinstance(parse_coordinator_frame(await connection.outbox.get()), Registered)
    assert session.online and services.registrations.in_flight == 0
    return connection, session, trust


class CallCounter:
    """Python calls into darkbloom's own code on this thread (event loop and library internals
    aside: their count depends on timing, not on the fleet)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _profile(self, frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and "/darkbloom/" in frame.f_code.co_filename:
            self.calls[frame.f_code.co_qualname] += 1

    def __enter__(self) -> "CallCounter":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


async def registration_work(engine: AsyncEngine, fleet: int) -> tuple[list[str], Counter[str]]:
    """The statements and darkbloom calls of one registration and its disconnection, with ``fleet``
    sessions of the same model and owner already registered and the views a request opens open."""
    services = services_on(engine, min_trust="self_signed", runtime_allow_list=frozenset({RUNTIME}))
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, f"owner-{fleet}@example.com", "h")
    registry = services.registry
    for _ in range(fleet):
        registry.add(SimProvider(models=(MODEL,), account=account_id).session)
    registry.open_view(("public", MODEL), (MODEL,), None, lambda s: s.online)
    registry.open_view(("owned", account_id, MODEL), (MODEL,), account_id, lambda s: s.online)
    identity = NodeIdentity.generate()
    token = await linked_token(engine, account_id)
    _, _, warm = await register(services, token, identity)  # a first one warms what is made once (caches, SQL)
    statements, stop = count(engine)
    try:
        with CallCounter() as calls:
            connection, _, trust = await register(services, token, identity)
            trust.cancel()
            connection.close()
    finally:
        stop()
        warm.cancel()
    assert len(registry) == fleet + 1  # the warm-up session is still there
    return statements.statements, calls.calls


async def test_a_registration_costs_the_same_at_10_and_at_1000_sessions(engine: AsyncEngine) -> None:
    small_statements, small_calls = await registration_work(engine, 10)
    large_statements, large_calls = await registration_work(engine, 1000)
    assert small_statements == large_statements
    assert len(small_statements) == 1  # the device token's owner; the machine is written in a batch later
    assert large_calls == small_calls, {name: (small_calls[name], large_calls[name])
                                        for name in small_calls | large_calls
                                        if small_calls[name] != large_calls[name]}


async def test_a_certificate_reads_the_enrollment_ca_once(engine: AsyncEngine) -> None:
    services = services_on(engine, min_trust="self_signed", runtime_allow_list=frozenset({RUNTIME}))
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "certified@example.com", "h")
    ca = await load_or_create_ca(engine)
    nodes = [NodeIdentity.generate() for _ in range(3)]
    tokens = [await linked_token(engine, account_id) for _ in nodes]
    certificates = [ca.issue(node.identity_key_b64, f"mach_{n}") for n, node in enumerate(nodes)]
    _, session, trust = await register(services, tokens[0], nodes[0], certificates[0])
    assert session.trust_level == "hardware"
    trusts = [trust]
    statements, stop = count(engine)
    try:
        for token, node, certificate in zip(tokens[1:], nodes[1:], certificates[1:]):
            _, session, trust = await register(services, token, node, certificate)
            trusts.append(trust)
            assert session.trust_level == "hardware"
    finally:
        stop()
        for trust in trusts:
            trust.cancel()
    assert not any("stored_settings" in s for s in statements.statements)
    assert len(statements.statements) == 2  # each one's device token, nothing else
