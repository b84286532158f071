"""Trust over real sockets: RawProvider against an in-process coordinator whose sessions we inspect.

Registration includes the first challenge; attestation decides none/self_signed; enrollment
certificates decide hardware; wrong answers, changed runtime hashes and missed deadlines make a
session untrusted (still online) at once; periodic challenges keep ``challenge_passed_at`` fresh."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from darkbloom.coordinator.fleet.trust import challenge_fresh
from darkbloom.wire.crypto import NodeIdentity, b64d
from darkbloom.wire.protocol import AttestationChallenge, AttestationResponse, Hardware, TrustStatus, dump
from darkbloom.wire.runtime import runtime_hash
from tests.support.raw_provider import RawProvider
from tests.coordinator.fleet.conftest import LiveCoordinator, enroll, link_device, machine
from tests.support.accounts import create_account

pytestmark = pytest.mark.e2e

Start = Callable[..., LiveCoordinator]


async def _registered(raw: RawProvider, timeout: float = 10) -> dict[str, Any]:
    return await asyncio.wait_for(raw.register(), timeout)


async def _until(raw: RawProvider, kind: type, timeout: float = 10) -> Any:
    return await asyncio.wait_for(raw.recv_until(kind), timeout)


async def _wait(predicate: Callable[[], Any], timeout: float = 10, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_valid_node_is_self_signed_and_online_only_after_the_first_challenge(live_coordinator: Start) -> None:
    coord = live_coordinator()
    owner = create_account(coord)
    token, machine_id = link_device(coord, owner)
    raw = RawProvider(coord.base_url, auth_token=token, challenge_answer="ignore",
                      hardware=Hardware(cpu_count=8, device="cuda", backend="llama-cpp"))
    ws = await raw.connect()
    await ws.send(dump(raw.register_frame()))
    challenge = await _until(raw, AttestationChallenge)
    assert len(b64d(challenge.nonce)) == 32 and abs(challenge.timestamp - time.time()) < 5

    # registered, but not listed until the challenge is answered
    assert not machine(coord, owner, machine_id)["online"]
    assert not any(s.machine_id == machine_id for s in coord.services.registry.all())
    await ws.send(dump(raw.challenge_response(challenge)))
    registered = await asyncio.wait_for(raw.recv(), 10)
    assert registered["type"] == "registered", registered
    assert registered["trust_level"] == "self_signed" and registered["account_id"] == owner.account_id

    session = coord.session(registered["provider_id"])
    assert session is not None and session.online and session.untrusted_reason is None
    assert (session.trust_level, session.runtime_verified) == ("self_signed", True)
    assert session.challenge_passed_at is not None and challenge_fresh(session, coord.settings)
    listed = machine(coord, owner, machine_id)
    assert (listed["online"], listed["session_id"], listed["trust_level"]) == \
        (True, registered["provider_id"], "self_signed")
    assert (listed["device"], listed["backend"]) == ("cuda", "llama-cpp")  # what its registration said
    await raw.close()


async def test_tampered_attestation_is_none(live_coordinator: Start) -> None:
    coord = live_coordinator()
    owner = create_account(coord)
    token, machine_id = link_device(coord, owner)
    raw = RawProvider(coord.base_url, auth_token=token, tamper_attestation=True)
    registered = await _registered(raw)
    assert registered["trust_level"] == "none"
    session = coord.session(registered["provider_id"])
    assert session is not None and session.online and session.untrusted_reason is None
    assert session.trust_level == "none" and session.challenge_passed_at is not None
    listed = machine(coord, owner, machine_id)
    assert (listed["online"], listed["trust_level"]) == (True, "none")
    await raw.close()


@pytest.mark.parametrize(("answer", "reason"), [("bad_signature", "signature"),
                                                ("changed_runtime", "runtime hash changed")])
async def test_wrong_first_answer_is_online_but_untrusted(live_coordinator: Start, answer: str, reason: str) -> None:
    coord = live_coordinator()
    owner = create_account(coord)
    token, machine_id = link_device(coord, owner)
    raw = RawProvider(coord.base_url, auth_token=token, challenge_answer=answer)
    registered = await _registered(raw)
    assert registered["trust_level"] == "untrusted"
    status = await _until(raw, TrustStatus)
    assert status.trust_level == "untrusted" and reason in status.reason
    session = coord.session(registered["provider_id"])
    assert session is not None and session.online
    assert session.untrusted_reason is not None and reason in session.untrusted_reason
    assert session.trust_level == "self_signed"  # what it attested; untrusted_reason is what rules it out
    assert session.challenge_passed_at is None and not challenge_fresh(session, coord.settings)
    listed = machine(coord, owner, machine_id)
    assert (listed["online"], listed["trust_level"]) == (True, "untrusted")
    await raw.close()
    listed = await _wait(lambda: (m := machine(coord, owner, machine_id)) and not m["online"] and m, what="offline")
    assert listed["trust_level"] == "untrusted"  # recorded on the machine


async def test_missed_registration_deadline_is_untrusted(live_coordinator: Start) -> None:
    coord = live_coordinator(challenge_deadline=1.0)
    raw = RawProvider(coord.base_url, challenge_answer="ignore")
    registered = await _registered(raw)
    assert registered["trust_level"] == "untrusted"
    status = await _until(raw, TrustStatus)
    assert "no answer" in status.reason  # the deadline's reason: it waited for it
    session = coord.session(registered["provider_id"])
    assert session is not None and session.online and "no answer" in (session.untrusted_reason or "")
    await raw.close()


async def test_periodic_challenges_keep_the_session_fresh(live_coordinator: Start) -> None:
    coord = live_coordinator(challenge_interval=0.3, challenge_deadline=2, challenge_freshness=1)
    raw = RawProvider(coord.base_url)
    registered = await _registered(raw)
    session = coord.session(registered["provider_id"])
    assert session is not None and session.challenge_passed_at is not None
    first_pass = session.challenge_passed_at
    while len(raw.challenges) < 5:  # 1 at registration + 4 periodic ones, each answered
        await _until(raw, AttestationChallenge)
    await _wait(lambda: session.challenge_passed_at > first_pass + 0.9, what="a later pass")
    nonces = [c.nonce for c in raw.challenges]
    assert len(set(nonces)) == len(nonces)
    assert session.untrusted_reason is None and challenge_fresh(session, coord.settings)
    assert registered["trust_level"] == "self_signed"
    await raw.close()


@pytest.mark.parametrize(("answer", "reason"), [("bad_signature", "signature"),
                                                ("changed_runtime", "runtime hash changed")])
async def test_wrong_periodic_answer_makes_it_untrusted_at_once(live_coordinator: Start, answer: str,
                                                                reason: str) -> None:
    # it sends no heartbeats: 1 s after its last answer it is evicted, five challenge intervals later
    coord = live_coordinator(challenge_interval=0.2, challenge_deadline=10, heartbeat_timeout=1.0,
                             eviction_interval=0.1)
    raw = RawProvider(coord.base_url)
    registered = await _registered(raw)
    session = coord.session(registered["provider_id"])
    assert session is not None and session.untrusted_reason is None
    raw.challenge_answer = answer
    await _until(raw, AttestationChallenge)  # answered wrongly by recv()
    status = await _until(raw, TrustStatus, timeout=5)  # well before the 10 s deadline
    assert status.trust_level == "untrusted" and reason in status.reason  # the answer's reason, not "no answer"
    assert session.online and reason in (session.untrusted_reason or "")
    # an untrusted session is challenged no more: nothing comes before the eviction closes the socket
    count = len(raw.challenges)
    with pytest.raises(ConnectionClosed):
        await _until(raw, AttestationChallenge)
    assert len(raw.challenges) == count


async def test_missed_periodic_deadline_makes_it_untrusted(live_coordinator: Start) -> None:
    coord = live_coordinator(challenge_interval=0.3, challenge_deadline=0.8)
    raw = RawProvider(coord.base_url)
    registered = await _registered(raw)
    raw.challenge_answer = "ignore"
    await _until(raw, AttestationChallenge)
    status = await _until(raw, TrustStatus, timeout=5)
    assert status.trust_level == "untrusted" and "no answer" in status.reason
    session = coord.session(registered["provider_id"])
    assert session is not None and session.online and session.untrusted_reason is not None
    await raw.close()


async def test_unsolicited_or_late_answers_are_ignored(live_coordinator: Start) -> None:
    coord = live_coordinator(challenge_interval=60)
    raw = RawProvider(coord.base_url)
    registered = await _registered(raw)
    assert raw.ws is not None
    stale = raw.challenges[0]
    await raw.ws.send(dump(raw.challenge_response(stale)))  # a replay of the answered challenge
    await raw.ws.send(dump(AttestationResponse(nonce=stale.nonce, signature="AAAA", runtime_hash="x")))
    await raw.ws.send(json.dumps({"type": "heartbeat"}))
    await raw.round_trip()  # the coordinator has handled all three
    session = coord.session(registered["provider_id"])
    assert session is not None and session.untrusted_reason is None and session.online
    await raw.close()


async def test_runtime_verified_only_for_allowed_hashes(live_coordinator: Start) -> None:
    other_release = "sha256:" + "ab" * 32
    coord = live_coordinator()
    raw = RawProvider(coord.base_url, runtime=other_release)
    registered = await _registered(raw)
    session = coord.session(registered["provider_id"])
    assert session is not None and registered["trust_level"] == "self_signed"
    assert session.runtime_verified is False and session.untrusted_reason is None
    await raw.close()

    allowing = live_coordinator(runtime_allow_list=frozenset({runtime_hash(), other_release}))
    for runtime in (other_release, runtime_hash()):
        raw = RawProvider(allowing.base_url, runtime=runtime)
        registered = await _registered(raw)
        session = allowing.session(registered["provider_id"])
        assert session is not None and session.runtime_verified is True
        await raw.close()


async def test_enrollment_grants_hardware_now_and_after_reconnecting(live_coordinator: Start) -> None:
    coord = live_coordinator()
    owner = create_account(coord)
    token, machine_id = link_device(coord, owner)
    identity = NodeIdentity.generate()
    raw = RawProvider(coord.base_url, auth_token=token, identity=identity)
    registered = await _registered(raw)
    assert registered["trust_level"] == "self_signed"

    response = await asyncio.to_thread(enroll, coord, machine_id)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"machine_id", "trust_level", "certificate"}
    assert (body["machine_id"], body["trust_level"]) == (machine_id, "hardware")
    status = await _until(raw, TrustStatus)
    assert (status.trust_level, status.certificate) == ("hardware", body["certificate"])
    session = coord.session(registered["provider_id"])
    assert session is not None and session.trust_level == "hardware"
    assert machine(coord, owner, machine_id)["trust_level"] == "hardware"
    await raw.close()

    # reconnect presenting the certificate: hardware from the registration itself
    again = RawProvider(coord.base_url, auth_token=token, identity=identity, certificate=body["certificate"])
    registered = await _registered(again)
    assert registered["trust_level"] == "hardware"
    listed = machine(coord, owner, machine_id)
    assert (listed["online"], listed["session_id"], listed["trust_level"]) == \
        (True, registered["provider_id"], "hardware")
    await again.close()

    # without it, or with a broken attestation, or presented by another key: no hardware
    for raw, expected in ((RawProvider(coord.base_url, auth_token=token, identity=identity), "self_signed"),
                          (RawProvider(coord.base_url, auth_token=token, identity=identity,
                                       certificate=body["certificate"], tamper_attestation=True), "none"),
                          (RawProvider(coord.base_url, certificate=body["certificate"]), "self_signed")):
        registered = await _registered(raw)
        assert registered["trust_level"] == expected, (raw.certificate is not None, raw.tamper_attestation)
        await raw.close()


async def test_enrolling_an_untrusted_session_hands_over_the_certificate_only(live_coordinator: Start) -> None:
    coord = live_coordinator()
    owner = create_account(coord)
    token, machine_id = link_device(coord, owner)
    raw = RawProvider(coord.base_url, auth_token=token, challenge_answer="bad_signature")
    registered = await _registered(raw)
    await _until(raw, TrustStatus)
    response = await asyncio.to_thread(enroll, coord, machine_id)
    assert response.status_code == 200 and response.json()["trust_level"] == "hardware"
    status = await _until(raw, TrustStatus)
    assert status.trust_level == "untrusted" and status.certificate == response.json()["certificate"]
    session = coord.session(registered["provider_id"])
    assert session is not None and session.untrusted_reason is not None and session.trust_level == "self_signed"
    await raw.close()


async def test_enroll_errors(live_coordinator: Start) -> None:
    coord = live_coordinator()
    owner = create_account(coord)
    _token, never_connected = link_device(coord, owner)

    def check() -> None:
        missing = enroll(coord, "mach_doesnotexist")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "machine_not_found"
        unregistered = enroll(coord, never_connected)
        assert unregistered.status_code == 409, unregistered.text
        error = unregistered.json()["error"]
        assert error["code"] == error["type"] == "machine_not_registered" and "never connected" in error["message"]
        assert enroll(coord, never_connected, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert enroll(coord, never_connected, headers=owner.headers()).status_code == 401
        httpx.delete(f"{coord.api_url}/me/providers/{never_connected}", headers=owner.headers()).raise_for_status()
        assert enroll(coord, never_connected).status_code == 404

    await asyncio.to_thread(check)
