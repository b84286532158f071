"""Provider session lifecycle: registration (owner stamped from the device token), heartbeats,
trust, eviction and disconnection.

Registration is two steps. ``open_session`` builds the session from the ``register`` frame (owner,
attested trust level, runtime verification). Then ``run_trust`` — a task of its own beside the
socket reader, so challenges never block reading — sends the first attestation challenge, and only
once it is answered (or has failed) ``complete_registration`` adds the session to the registry,
sends ``registered`` and marks it ``online``. After that ``run_trust`` challenges the session every
``challenge_interval`` until it disconnects or becomes untrusted.

``online`` means "connected and registered"; ``untrusted_reason`` (set by ``distrust``) means
"failed a check, never routable again". An untrusted session stays online (docs/protocol.md "Registration
and trust"), so every routing path must check ``untrusted_reason is None`` besides ``online``.

What a session says of its machine (last seen, models, trust) is marked on the machine book
(``fleet/machine_book.py``), which writes it in batches: nothing here waits on the database for it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dataclasses import dataclass, replace

from prometheus_client import Histogram

from darkbloom.coordinator.fleet.enrollment import EnrollmentCA, load_ca
from darkbloom.coordinator.fleet.registration_gate import Registering
from darkbloom.coordinator.fleet.session import Link, ProviderSession
from darkbloom.coordinator.services import Services
from darkbloom.coordinator.fleet.trust import (
    UNTRUSTED,
    certificate_problem,
    challenge_failure,
    effective_trust,
    new_challenge,
    registration_trust,
    runtime_allowed,
)
from darkbloom.wire.crypto import DecryptionError, new_id, public_key_from_b64, token_hash
from darkbloom.wire.protocol import (
    AttestationChallenge,
    AttestationResponse,
    Heartbeat,
    Register,
    Registered,
    TrustStatus,
    dump,
)
from darkbloom.store.machines import Seen

log = logging.getLogger("darkbloom.sessions")

MACHINE_SEEN_EVERY = 60.0
SERVICE_RESTART = 1012  # the close code that tells a node this process is stopping (docs/protocol.md "Reconnecting")
GOING_AWAY = 1001
REGISTRATION_SECONDS = Histogram(
    "darkbloom_registration_seconds",
    "From a provider socket's accept to its registered frame (the first challenge included), by the trust "
    "it registered with: none, self_signed, hardware, untrusted",
    ["trust"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


async def _owner_of(services: Services, auth_token: str | None) -> tuple[str, str] | None:
    if not auth_token or not auth_token.startswith("dkp-"):
        return None
    return await services.device_owners.owner(token_hash(auth_token))


async def open_session(services: Services, registration: Register, link: Link,
                       accepted_at: float) -> ProviderSession:
    """Create the session, reached through ``link``, whose socket was accepted at ``accepted_at``
    (monotonic); the owner comes only from the device token, never from the frame."""
    owner = await _owner_of(services, registration.auth_token)
    try:
        public_key = public_key_from_b64(registration.public_key)
    except DecryptionError:
        public_key = None
    session = ProviderSession(
        id=new_id("prov_"), account_id=owner[0] if owner else None, machine_id=owner[1] if owner else None,
        registration=registration, public_key=public_key, link=link, connected_at=accepted_at,
        trust_level=await _registration_trust(services, registration) if public_key is not None else "none")
    session.runtime_verified = runtime_allowed(services.settings, registration.runtime_hash)
    if not session.runtime_verified:
        log.warning("provider %s: runtime hash %s is not in the allow-list (runtime not verified)",
                    session.id, registration.runtime_hash or "(none)")
    if public_key is None:
        session.untrusted_reason = "no valid X25519 public key"
    return session


async def _registration_trust(services: Services, registration: Register) -> str:
    """``self_signed`` from the attestation blob; ``hardware`` when it also presents a certificate
    from this coordinator's enrollment CA for its identity key."""
    ca = await _enrollment_ca(services) if registration.certificate else None
    level = registration_trust(registration, ca)
    if registration.certificate and level == "self_signed":
        log.warning("a provider presented a certificate that does not prove hardware trust: %s",
                    certificate_problem(registration, ca))
    return level


async def _enrollment_ca(services: Services) -> EnrollmentCA | None:
    try:
        return await load_ca(services.engine)
    except Exception:  # noqa: BLE001 - an unreadable CA means no hardware trust, not a dead socket
        log.exception("cannot load the enrollment CA")
        return None


async def run_trust(services: Services, session: ProviderSession, registering: Registering) -> None:
    """The session's trust work, run as its own task for as long as the socket is open: the first
    challenge (part of registration), then ``complete_registration`` (``registering`` ends there),
    then one challenge every ``challenge_interval`` while the session is trusted."""
    try:
        if session.untrusted_reason is None:
            await _challenge(services, session)
        complete_registration(services, session)
        registering.done()
        while session.untrusted_reason is None:
            await asyncio.sleep(services.settings.challenge_interval)
            await _challenge(services, session)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - without its trust checks a session must not stay connected
        log.exception("provider %s: trust checks failed; closing the session", session.id)
        session.close(1011)


def complete_registration(services: Services, session: ProviderSession) -> None:
    """After the first challenge: list the session (online, routable if trusted) and tell the node."""
    if session.link.closing:
        return  # the socket is closing; never list it
    services.registry.add(session)
    session.send(dump(Registered(provider_id=session.id, account_id=session.account_id,
                                 machine_id=session.machine_id, trust_level=effective_trust(session),
                                 chunk_arrays=True)))
    if session.untrusted_reason is not None:
        session.send(dump(TrustStatus(trust_level=UNTRUSTED, reason=session.untrusted_reason)))
    session.online = True
    REGISTRATION_SECONDS.labels(effective_trust(session)).observe(time.monotonic() - session.connected_at)
    _record_machine(services, session)
    log.info("provider %s registered: account=%s machine=%s models=%s trust=%s runtime_verified=%s "
             "private_only=%s", session.id, session.account_id, session.machine_id,
             sorted(session.advertised_models), effective_trust(session), session.runtime_verified,
             session.private_only)


def close_session(services: Services, session: ProviderSession) -> None:
    """Take the session out of routing and fail whatever it was serving. Idempotent."""
    if not services.registry.remove(session):
        return
    session.disconnected()
    log.info("provider %s disconnected", session.id)
    _record_machine(services, session)


def on_heartbeat(services: Services, session: ProviderSession, frame: Heartbeat) -> None:
    if "models" in frame.model_fields_set:  # the models loaded now (the scheduler prefers those)
        session.report_loaded(frame.models)
    if time.monotonic() - session.machine_seen_at >= MACHINE_SEEN_EVERY:
        _record_machine(services, session)


def unchanged_heartbeats_idle_for(session: ProviderSession) -> float:
    """Seconds for which heartbeats identical to one about to reach ``on_heartbeat`` tell it nothing
    (their arrival still counts for liveness): until the machine is next due to be marked seen, a
    whole ``MACHINE_SEEN_EVERY`` when this heartbeat is the one that marks it."""
    due_in = session.machine_seen_at + MACHINE_SEEN_EVERY - time.monotonic()
    return due_in if due_in > 0 else MACHINE_SEEN_EVERY


@dataclass(eq=False)
class _Outstanding:
    challenge: AttestationChallenge
    answered: asyncio.Future[str | None]  # the failure reason, or None when the answer passed


_outstanding: dict[str, _Outstanding] = {}  # session id → its unanswered challenge (at most one)


async def _challenge(services: Services, session: ProviderSession) -> None:
    """Send one challenge and wait for ``on_attestation_response`` to judge the answer; no answer
    within ``challenge_deadline`` makes the session untrusted."""
    deadline = services.settings.challenge_deadline
    outstanding = _Outstanding(new_challenge(), asyncio.get_running_loop().create_future())
    _outstanding[session.id] = outstanding
    try:
        session.send(dump(outstanding.challenge))
        async with asyncio.timeout(deadline):
            await outstanding.answered
    except TimeoutError:
        distrust(session, f"no answer to the attestation challenge within {deadline:g} s", services)
    finally:
        if _outstanding.get(session.id) is outstanding:
            del _outstanding[session.id]


def on_attestation_response(services: Services, session: ProviderSession, frame: AttestationResponse) -> None:
    """Judge an answer at once: a pass refreshes ``challenge_passed_at``; a bad signature or a
    changed runtime hash makes the session untrusted. An answer to no outstanding challenge
    (unsolicited, or after its deadline) is ignored."""
    outstanding = _outstanding.get(session.id)
    if outstanding is None or outstanding.answered.done() or frame.nonce != outstanding.challenge.nonce:
        log.info("provider %s: ignoring an attestation response to no outstanding challenge", session.id)
        return
    failure = challenge_failure(outstanding.challenge, frame, session.registration)
    if failure is None:
        session.challenge_passed_at = time.monotonic()
        log.debug("provider %s passed an attestation challenge", session.id)
    else:
        distrust(session, failure, services)
    outstanding.answered.set_result(failure)


def distrust(session: ProviderSession, reason: str, services: Services | None = None) -> None:
    """Mark the session untrusted for good: it stays connected and ``online`` (listed, with trust
    ``untrusted``) but no routing path may use it. Tells the node with a ``trust_status`` frame
    (at registration the ``registered`` frame carries it) and, given ``services``, records it on
    the machine."""
    if session.untrusted_reason is not None:
        return
    session.untrusted_reason = reason
    log.warning("provider %s marked untrusted: %s", session.id, reason)
    if session.online:
        session.send(dump(TrustStatus(trust_level=UNTRUSTED, reason=reason)))
        if services is not None:
            _record_machine(services, session)


def on_enrolled(services: Services, session: ProviderSession, certificate: str, ca: EnrollmentCA) -> None:
    """An admin enrolled this session's machine: hand the node its certificate (it presents it at
    later registrations) and, when the live session already proved ``self_signed`` with the
    certified key and is trusted, raise it to ``hardware`` now."""
    if ca.verify(certificate, session.registration.identity_key) is not None:
        return  # issued for another identity key than this session's
    if session.trust_level == "self_signed" and session.untrusted_reason is None:
        session.trust_level = "hardware"
    level = effective_trust(session)
    reason = "enrolled" if level == "hardware" else \
        f"enrolled; this session stays {level} (hardware trust needs a valid attestation)"
    session.send(dump(TrustStatus(trust_level=level, reason=reason, certificate=certificate)))
    log.info("provider %s enrolled (machine %s): trust %s", session.id, session.machine_id, level)
    if session.online:
        _record_machine(services, session)


def _record_machine(services: Services, session: ProviderSession) -> None:
    """Mark the machine with what its session says now; the machine book writes it with its next batch."""
    if session.machine_id is None:
        return
    seen = Seen(last_seen=int(time.time()), models=sorted(session.advertised_models),
                trust_level=effective_trust(session), private_only=session.private_only,
                name=session.registration.name or None, identity_key=session.registration.identity_key or None)
    if session.machine_marked is not None and replace(session.machine_marked, last_seen=seen.last_seen) == seen:
        services.machine_book.touch(session.machine_id, seen.last_seen)  # still there, nothing else new
    else:
        services.machine_book.mark(session.machine_id, seen)
    session.machine_seen_at, session.machine_marked = time.monotonic(), seen


async def evict_silent(services: Services) -> None:
    """Evict every session that sent nothing for ``heartbeat_timeout`` seconds; runs forever."""
    settings = services.settings
    while True:
        await asyncio.sleep(settings.eviction_interval)
        deadline = time.monotonic() - settings.heartbeat_timeout
        for session in services.registry.silent_since(deadline):
            log.warning("provider %s silent for %.0f s: evicting", session.id, settings.heartbeat_timeout)
            close_session(services, session)
            session.close(GOING_AWAY)
