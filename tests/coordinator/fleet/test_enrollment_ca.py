"""The enrollment CA: issuing and verifying hardware-trust certificates, and its one stored copy."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from darkbloom.coordinator.fleet.enrollment import (
    CA_COMMON_NAME,
    CertificateError,
    EnrollmentCA,
    load_ca,
    load_or_create_ca,
)
from darkbloom.wire.crypto import NodeIdentity
from darkbloom.store import create_engine, migrate

DAY = 86400


@pytest.fixture(scope="module")
def ca() -> EnrollmentCA:
    return EnrollmentCA.generate()


@pytest.fixture
def node() -> NodeIdentity:
    return NodeIdentity.generate()


def test_issued_certificate_verifies_for_its_identity_key(ca: EnrollmentCA, node: NodeIdentity) -> None:
    pem = ca.issue(node.identity_key_b64, "mach_abc")
    assert pem.startswith("-----BEGIN CERTIFICATE-----")
    assert ca.verify(pem, node.identity_key_b64) is None
    cert = x509.load_pem_x509_certificate(pem.encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "mach_abc"
    assert cert.issuer == ca.certificate.subject
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    raw = cert.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert raw == bytes(node.signing_key.verify_key)


def test_ca_certificate_is_a_self_signed_ca(ca: EnrollmentCA) -> None:
    cert = ca.certificate
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == CA_COMMON_NAME
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    cert.verify_directly_issued_by(cert)


def test_certificate_from_another_ca_is_refused(ca: EnrollmentCA, node: NodeIdentity) -> None:
    other = EnrollmentCA.generate()
    pem = other.issue(node.identity_key_b64, "mach_abc")
    assert other.verify(pem, node.identity_key_b64) is None
    assert "signature does not verify" in (ca.verify(pem, node.identity_key_b64) or "")


def test_certificate_from_a_differently_named_ca_is_refused(ca: EnrollmentCA, node: NodeIdentity) -> None:
    other = EnrollmentCA.generate(common_name="Someone else's CA")
    assert "not issued by" in (ca.verify(other.issue(node.identity_key_b64, "mach_abc"), node.identity_key_b64) or "")


def test_certificate_for_another_identity_key_is_refused(ca: EnrollmentCA, node: NodeIdentity) -> None:
    pem = ca.issue(node.identity_key_b64, "mach_abc")
    stranger = NodeIdentity.generate()
    assert "different identity key" in (ca.verify(pem, stranger.identity_key_b64) or "")


def test_expired_and_not_yet_valid_certificates_are_refused(ca: EnrollmentCA, node: NodeIdentity) -> None:
    issued_at = time.time()
    pem = ca.issue(node.identity_key_b64, "mach_abc", valid_days=1, now=issued_at)
    assert ca.verify(pem, node.identity_key_b64, now=issued_at + DAY - 60) is None
    assert "expired" in (ca.verify(pem, node.identity_key_b64, now=issued_at + DAY + 60) or "")
    assert ca.verify(pem, node.identity_key_b64) is None
    future = ca.issue(node.identity_key_b64, "mach_abc", now=issued_at + 10 * DAY)
    assert "not yet valid" in (ca.verify(future, node.identity_key_b64, now=issued_at) or "")


def test_the_ca_certificate_itself_is_not_an_enrollment(ca: EnrollmentCA) -> None:
    ca_key_b64 = __import__("base64").b64encode(ca.key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()
    assert "end-entity" in (ca.verify(ca.certificate_pem, ca_key_b64) or "")


def test_forged_certificate_with_the_ca_name_is_refused(ca: EnrollmentCA, node: NodeIdentity) -> None:
    """Same issuer name, same subject key, but signed by a key that is not the CA's."""
    forger = Ed25519PrivateKey.generate()
    now = dt.datetime.now(dt.timezone.utc)
    legit = x509.load_pem_x509_certificate(ca.issue(node.identity_key_b64, "mach_abc").encode())
    forged = (x509.CertificateBuilder().subject_name(legit.subject).issuer_name(ca.certificate.subject)
              .public_key(legit.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .sign(forger, None))
    pem = forged.public_bytes(serialization.Encoding.PEM).decode()
    assert "signature does not verify" in (ca.verify(pem, node.identity_key_b64) or "")


@pytest.mark.parametrize("garbage", ["", "not a certificate", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"])
def test_garbage_is_refused(ca: EnrollmentCA, node: NodeIdentity, garbage: str) -> None:
    assert ca.verify(garbage, node.identity_key_b64) is not None


@pytest.mark.parametrize("bad_key", ["", "!!!", "AAAA"])
def test_issuing_for_a_malformed_identity_key_fails(ca: EnrollmentCA, bad_key: str) -> None:
    with pytest.raises(CertificateError):
        ca.issue(bad_key, "mach_abc")


def test_stored_form_round_trips(ca: EnrollmentCA, node: NodeIdentity) -> None:
    again = EnrollmentCA.from_stored(ca.to_stored())
    assert again.certificate == ca.certificate
    assert again.verify(ca.issue(node.identity_key_b64, "mach_x"), node.identity_key_b64) is None
    assert ca.verify(again.issue(node.identity_key_b64, "mach_x"), node.identity_key_b64) is None


async def test_one_ca_per_database_shared_by_replicas(database_url: str, node: NodeIdentity) -> None:
    """Created once, on first use; concurrent replicas (separate engines) all end up with the same CA."""
    engines = [create_engine(database_url) for _ in range(3)]
    try:
        await migrate(engines[0])
        assert await load_ca(engines[0]) is None
        cas = await asyncio.gather(*(load_or_create_ca(engine) for engine in engines))
        assert len({ca.certificate_pem for ca in cas}) == 1
        later = await load_or_create_ca(engines[1])
        assert later.certificate_pem == cas[0].certificate_pem
        pem = cas[2].issue(node.identity_key_b64, "mach_x")
        assert (await load_ca(engines[0])).verify(pem, node.identity_key_b64) is None  # type: ignore[union-attr]
    finally:
        for engine in engines:
            await engine.dispose()
