"""The node saves an enrollment certificate only when it is one PEM end-entity certificate, within
its validity, for the node's own identity key (it cannot check the CA's signature)."""

from __future__ import annotations

import datetime as dt
import logging
import stat
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from darkbloom import paths
from darkbloom.coordinator.fleet.enrollment import EnrollmentCA
from darkbloom.provider.registration import certificate_problem, read_certificate, save_certificate
from darkbloom.wire.crypto import NodeIdentity, b64e

YEAR = 365 * 86400


@pytest.fixture(scope="module")
def ca() -> EnrollmentCA:
    return EnrollmentCA.generate()


@pytest.fixture
def node() -> NodeIdentity:
    return NodeIdentity.generate()


def _node_key(node: NodeIdentity) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(bytes(node.signing_key.verify_key))


def _ca_key_b64(ca: EnrollmentCA) -> str:
    return b64e(ca.key.public_key().public_bytes_raw())


def _self_made(public_key: CertificatePublicKeyTypes, signer: ec.EllipticCurvePrivateKey | Ed25519PrivateKey,
               constraints: x509.BasicConstraints | None = None) -> str:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mach_x")])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public_key)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1)))
    if constraints is not None:
        builder = builder.add_extension(constraints, critical=True)
    algorithm = hashes.SHA256() if isinstance(signer, ec.EllipticCurvePrivateKey) else None
    return builder.sign(signer, algorithm).public_bytes(Encoding.PEM).decode()


def test_a_certificate_the_ca_issued_for_this_node_is_saved(ca: EnrollmentCA, node: NodeIdentity,
                                                            tmp_path: Path) -> None:
    pem = ca.issue(node.identity_key_b64, "mach_1")
    assert certificate_problem(pem, node.identity_key_b64) is None
    assert save_certificate(tmp_path, pem, node.identity_key_b64)
    path = paths.certificate_path(tmp_path)
    assert path.read_text() == pem and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_certificate(tmp_path) == pem


def test_an_end_entity_certificate_without_basic_constraints_is_accepted(node: NodeIdentity) -> None:
    pem = _self_made(_node_key(node),
                     Ed25519PrivateKey.generate())
    assert certificate_problem(pem, node.identity_key_b64) is None


def _refused(ca: EnrollmentCA, node: NodeIdentity) -> dict[str, tuple[str, str, str]]:
    """name -> (certificate, identity key, words the reason has)"""
    key = node.identity_key_b64
    issued = ca.issue(key, "mach_1")
    return {
        "empty": ("", key, "PEM"),
        "junk": ("not a certificate", key, "PEM"),
        "bad base64 inside PEM": ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", key, "X.509"),
        "text around the PEM": (f"hello\n{issued}", key, "PEM"),
        "a private key alongside": (issued + "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", key,
                                    "PEM"),
        "two certificates": (issued + ca.issue(key, "mach_2"), key, "exactly one"),
        "another identity key": (ca.issue(NodeIdentity.generate().identity_key_b64, "mach_1"), key,
                                 "different identity key"),
        "expired": (ca.issue(key, "mach_1", valid_days=365, now=time.time() - 2 * YEAR), key, "expired"),
        "not yet valid": (ca.issue(key, "mach_1", now=time.time() + YEAR), key, "not yet valid"),
        "the CA certificate": (ca.certificate_pem, _ca_key_b64(ca), "CA certificate"),
        "a CA certificate for this key": (
            _self_made(_node_key(node),
                       Ed25519PrivateKey.generate(), x509.BasicConstraints(ca=True, path_length=None)),
            key, "CA certificate"),
        "not an Ed25519 key": (_self_made(ec.generate_private_key(ec.SECP256R1()).public_key(),
                                          ec.generate_private_key(ec.SECP256R1())), key, "different identity key"),
    }


CASES = list(_refused(EnrollmentCA.generate(), NodeIdentity.generate()))


@pytest.mark.parametrize("case", CASES)
def test_a_bad_certificate_is_refused_and_nothing_is_written(case: str, ca: EnrollmentCA, node: NodeIdentity,
                                                             tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pem, key, words = _refused(ca, node)[case]
    problem = certificate_problem(pem, key)
    assert problem is not None and words in problem, problem
    with caplog.at_level(logging.WARNING, logger="darkbloom.provider.registration"):
        assert not save_certificate(tmp_path, pem, key)
    assert not paths.certificate_path(tmp_path).exists()
    assert any(problem in r.getMessage() for r in caplog.records)
    if pem.strip():
        assert all(pem.strip() not in r.getMessage() for r in caplog.records)


def test_a_refused_certificate_leaves_the_saved_one(ca: EnrollmentCA, node: NodeIdentity, tmp_path: Path) -> None:
    good = ca.issue(node.identity_key_b64, "mach_1")
    assert save_certificate(tmp_path, good, node.identity_key_b64)
    assert not save_certificate(tmp_path, ca.issue(NodeIdentity.generate().identity_key_b64, "mach_1"),
                                node.identity_key_b64)
    assert paths.certificate_path(tmp_path).read_text() == good
