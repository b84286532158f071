"""Attestation, hardware trust, challenge answers, freshness and the runtime allow-list (pure functions)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from darkbloom import cli
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.enrollment import EnrollmentCA
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.trust import (
    attestation_trust,
    certificate_problem,
    challenge_failure,
    challenge_fresh,
    new_challenge,
    registration_trust,
    runtime_allowed,
    trust_at_least,
)
from darkbloom.wire.crypto import NodeIdentity, b64d, challenge_message
from darkbloom.wire.protocol import AttestationResponse, ModelInfo, Register
from darkbloom.coordinator.fleet.connection import OutboxLink
from darkbloom.wire.runtime import runtime_hash

RUNTIME = runtime_hash()


def _register(node: NodeIdentity, **changes: object) -> Register:
    fields: dict[str, object] = dict(
        models=[ModelInfo(id="m")], runtime_hash=RUNTIME, public_key=node.public_key_b64,
        identity_key=node.identity_key_b64, attestation=node.attestation(RUNTIME))
    fields.update(changes)
    return Register(**fields)  # type: ignore[arg-type]


def _blob(attestation: str) -> dict[str, str]:
    return json.loads(base64.b64decode(attestation))


def _pack(blob: dict[str, str]) -> str:
    return base64.b64encode(json.dumps(blob).encode()).decode()


@pytest.fixture
def node() -> NodeIdentity:
    return NodeIdentity.generate()


# attestation (self_signed)


def test_valid_attestation_is_self_signed(node: NodeIdentity) -> None:
    assert attestation_trust(_register(node)) == "self_signed"


def test_attestation_with_a_flipped_signature_bit_is_none(node: NodeIdentity) -> None:
    blob = _blob(node.attestation(RUNTIME))
    signature = bytearray(b64d(blob["signature"]))
    signature[10] ^= 0x80
    blob["signature"] = base64.b64encode(bytes(signature)).decode()
    assert attestation_trust(_register(node, attestation=_pack(blob))) == "none"


def test_attestation_with_an_edited_body_is_none(node: NodeIdentity) -> None:
    blob = _blob(node.attestation(RUNTIME))
    body = json.loads(blob["body"])
    body["runtime_hash"] = "sha256:" + "0" * 64
    blob["body"] = json.dumps(body, sort_keys=True, separators=(",", ":"))
    # the frame claims the edited runtime too, so only the signature can catch it
    assert attestation_trust(_register(node, attestation=_pack(blob), runtime_hash=body["runtime_hash"])) == "none"


def test_attestation_must_match_the_frame(node: NodeIdentity) -> None:
    other = NodeIdentity.generate()
    assert attestation_trust(_register(node, public_key=other.public_key_b64)) == "none"
    assert attestation_trust(_register(node, runtime_hash="sha256:other")) == "none"
    # a blob signed by another key, presented with that other identity key but our encryption key
    assert attestation_trust(_register(node, attestation=other.attestation(RUNTIME))) == "none"


def test_attestation_outside_two_minutes_is_none(node: NodeIdentity) -> None:
    now = int(time.time())
    assert attestation_trust(_register(node, attestation=node.attestation(RUNTIME, now - 110))) == "self_signed"
    assert attestation_trust(_register(node, attestation=node.attestation(RUNTIME, now - 130))) == "none"
    assert attestation_trust(_register(node, attestation=node.attestation(RUNTIME, now + 130))) == "none"


@pytest.mark.parametrize("attestation", ["", "%%%", base64.b64encode(b"[]").decode(),
                                         base64.b64encode(b'{"body": 5}').decode(),
                                         base64.b64encode(b'{"body": "{\\"timestamp\\": \\"x\\"}"}').decode()])
def test_malformed_attestation_is_none(node: NodeIdentity, attestation: str) -> None:
    assert attestation_trust(_register(node, attestation=attestation)) == "none"


# certificates (hardware)


def test_certificate_makes_hardware_only_with_a_valid_attestation(node: NodeIdentity) -> None:
    ca = EnrollmentCA.generate()
    certificate = ca.issue(node.identity_key_b64, "mach_1")
    assert registration_trust(_register(node, certificate=certificate), ca) == "hardware"
    assert registration_trust(_register(node), ca) == "self_signed"
    assert registration_trust(_register(node, certificate=certificate), None) == "self_signed"
    tampered = _register(node, certificate=certificate, attestation=NodeIdentity.generate().attestation(RUNTIME))
    assert registration_trust(tampered, ca) == "none"


def test_certificate_of_another_ca_or_key_is_self_signed(node: NodeIdentity) -> None:
    ca = EnrollmentCA.generate()
    foreign = EnrollmentCA.generate().issue(node.identity_key_b64, "mach_1")
    assert registration_trust(_register(node, certificate=foreign), ca) == "self_signed"
    for_someone_else = ca.issue(NodeIdentity.generate().identity_key_b64, "mach_2")
    assert registration_trust(_register(node, certificate=for_someone_else), ca) == "self_signed"
    assert "different identity key" in (certificate_problem(_register(node, certificate=for_someone_else), ca) or "")
    assert certificate_problem(_register(node), ca) == "no certificate presented"


# challenges


def _answer(node: NodeIdentity, nonce: str, timestamp: int, runtime: str = RUNTIME) -> AttestationResponse:
    return AttestationResponse(nonce=nonce, signature=node.sign(challenge_message(nonce, timestamp, runtime)),
                               runtime_hash=runtime)


def test_new_challenge_has_a_32_byte_nonce_and_the_time() -> None:
    first, second = new_challenge(), new_challenge()
    assert len(b64d(first.nonce)) == 32 and first.nonce != second.nonce
    assert abs(first.timestamp - time.time()) < 5


def test_correct_answer_passes(node: NodeIdentity) -> None:
    challenge = new_challenge()
    assert challenge_failure(challenge, _answer(node, challenge.nonce, challenge.timestamp), _register(node)) is None


def test_wrong_answers_fail(node: NodeIdentity) -> None:
    challenge = new_challenge()
    registration = _register(node)
    stale = new_challenge()
    cases = {
        "different challenge": _answer(node, stale.nonce, stale.timestamp),
        "signature": _answer(node, challenge.nonce, challenge.timestamp + 1),  # signed over another timestamp
        "runtime hash changed": _answer(node, challenge.nonce, challenge.timestamp, "sha256:changed"),
    }
    for expected, answer in cases.items():
        failure = challenge_failure(challenge, answer, registration)
        assert failure is not None and expected in failure, (expected, failure)
    by_stranger = _answer(NodeIdentity.generate(), challenge.nonce, challenge.timestamp)
    assert "signature" in (challenge_failure(challenge, by_stranger, registration) or "")
    garbage = AttestationResponse(nonce=challenge.nonce, signature="***", runtime_hash=RUNTIME)
    assert challenge_failure(challenge, garbage, registration) is not None
    assert challenge_failure(challenge, _answer(node, challenge.nonce, challenge.timestamp),
                             _register(node, identity_key="")) is not None


def _session(node: NodeIdentity) -> ProviderSession:
    return ProviderSession(id="prov_x", account_id=None, machine_id=None, registration=_register(node),
                           public_key=None, link=OutboxLink(), trust_level="self_signed")


def test_challenge_freshness_window(node: NodeIdentity) -> None:
    settings = CoordinatorSettings(challenge_freshness=960)
    session = _session(node)
    assert not challenge_fresh(session, settings, now=1000.0)
    session.record_challenge_pass(1000.0)
    assert challenge_fresh(session, settings, now=1000.0 + 960)
    assert not challenge_fresh(session, settings, now=1000.0 + 961)
    session.record_challenge_pass(time.monotonic())
    assert challenge_fresh(session, settings)


def test_effective_trust_and_levels(node: NodeIdentity) -> None:
    session = _session(node)
    assert session.effective_trust == "self_signed"
    session.distrust("failed a challenge")
    assert session.effective_trust == "untrusted" and session.trust_level == "self_signed"
    assert trust_at_least("hardware", "self_signed") and trust_at_least("none", "none")
    assert not trust_at_least("self_signed", "hardware") and not trust_at_least("untrusted", "none")


# settings and flags


def test_runtime_allow_list_defaults_to_this_release() -> None:
    settings = CoordinatorSettings()
    assert settings.runtime_allow_list == frozenset({RUNTIME})
    assert runtime_allowed(settings, RUNTIME)
    assert not runtime_allowed(settings, "sha256:someone-else") and not runtime_allowed(settings, "")
    assert (settings.challenge_interval, settings.challenge_deadline, settings.challenge_freshness) == (300, 30, 960)


@pytest.mark.parametrize("name", ["challenge_interval", "challenge_deadline", "challenge_freshness"])
def test_periods_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("_", "-")):
        CoordinatorSettings(**{name: 0})  # type: ignore[arg-type]


def test_coordinator_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DARKBLOOM_HOME", str(tmp_path))
    seen: list[CoordinatorSettings] = []
    monkeypatch.setattr("darkbloom.coordinator.server.run", seen.append)
    result = CliRunner().invoke(cli.app, [
        "coordinator", "--runtime-allow", "sha256:aaa", "--runtime-allow", "sha256:bbb",
        "--challenge-interval", "2", "--challenge-deadline", "1.5", "--challenge-freshness", "7"])
    assert result.exit_code == 0, result.output
    [settings] = seen
    assert settings.runtime_allow_list == {RUNTIME, "sha256:aaa", "sha256:bbb"}
    assert (settings.challenge_interval, settings.challenge_deadline, settings.challenge_freshness) == (2, 1.5, 7)
    monkeypatch.setenv("DARKBLOOM_CHALLENGE_INTERVAL", "9")
    seen.clear()
    assert CliRunner().invoke(cli.app, ["coordinator"]).exit_code == 0
    assert seen[0].challenge_interval == 9 and seen[0].runtime_allow_list == {RUNTIME}
    bad = CliRunner().invoke(cli.app, ["coordinator", "--challenge-deadline", "0"])
    assert bad.exit_code == 2
