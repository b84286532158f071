"""The enrollment CA behind ``hardware`` trust (docs/protocol.md "Registration and trust", docs/api.md "Admin").

The coordinator keeps one CA: an Ed25519 key and a self-signed X.509 certificate, created the
first time it is needed and stored in the database (``stored_settings``, name ``enrollment_ca``)
so that every replica issues and verifies with the same one. An admin enrolls a linked machine
(``POST /v1/admin/machines/{id}/enroll``): the CA issues a certificate for the Ed25519 identity key
the machine registered with, the certificate is kept on the machine record and handed to the node
(``trust_status``), and the node presents it as ``register.certificate`` from then on. A
registration whose certificate chains to the CA, is within its validity and names the
registration's identity key (and whose attestation verifies) is ``hardware``.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.wire.crypto import b64d
from darkbloom.store import stored_settings

log = logging.getLogger("darkbloom.enrollment")

STORED_NAME = "enrollment_ca"
CA_COMMON_NAME = "Darkbloom enrollment CA"
CA_VALIDITY = dt.timedelta(days=3650)
BACKDATE = dt.timedelta(minutes=5)  # tolerate clocks a little behind the coordinator's


class CertificateError(ValueError):
    """An identity key the CA cannot certify."""


def _utc(now: float | None) -> dt.datetime:
    return dt.datetime.fromtimestamp(time.time() if now is None else now, tz=dt.timezone.utc)


def _identity_public_key(identity_key_b64: str) -> Ed25519PublicKey:
    try:
        raw = b64d(identity_key_b64)
    except (ValueError, UnicodeEncodeError):
        raise CertificateError("the identity key is not valid base64") from None
    if len(raw) != 32:
        raise CertificateError("the identity key must be a 32-byte Ed25519 public key")
    return Ed25519PublicKey.from_public_bytes(raw)


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class EnrollmentCA:
    key: Ed25519PrivateKey
    certificate: x509.Certificate

    @classmethod
    def generate(cls, now: float | None = None, common_name: str = CA_COMMON_NAME) -> "EnrollmentCA":
        key = Ed25519PrivateKey.generate()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        start = _utc(now) - BACKDATE
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, None)
        )
        return cls(key, certificate)

    # storage (a JSON value in stored_settings)

    def to_stored(self) -> dict[str, str]:
        key_pem = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
        return {"key_pem": key_pem.decode(), "certificate_pem": self.certificate_pem}

    @classmethod
    def from_stored(cls, value: dict[str, Any]) -> "EnrollmentCA":
        key = serialization.load_pem_private_key(value["key_pem"].encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the stored enrollment CA key is not Ed25519")
        return cls(key, x509.load_pem_x509_certificate(value["certificate_pem"].encode()))

    @property
    def certificate_pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode()

    # issuing and verifying

    def issue(self, identity_key_b64: str, subject: str, valid_days: float = 365,
              now: float | None = None) -> str:
        """A PEM certificate binding ``identity_key_b64`` (the node's Ed25519 identity key), with
        ``subject`` (the machine id) as common name, signed by this CA."""
        public_key = _identity_public_key(identity_key_b64)
        start = _utc(now) - BACKDATE
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + BACKDATE + dt.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, None)
        )
        return certificate.public_bytes(serialization.Encoding.PEM).decode()

    def verify(self, certificate_pem: str, identity_key_b64: str, now: float | None = None) -> str | None:
        """Why ``certificate_pem`` does not certify ``identity_key_b64`` under this CA, or None when it does."""
        try:
            certificate = x509.load_pem_x509_certificate(certificate_pem.encode())
        except (ValueError, UnicodeEncodeError, TypeError):
            return "the certificate is not a PEM X.509 certificate"
        if certificate.issuer != self.certificate.subject:
            return "the certificate was not issued by this coordinator's enrollment CA"
        try:
            self.key.public_key().verify(certificate.signature, certificate.tbs_certificate_bytes)
        except InvalidSignature:
            return "the certificate's signature does not verify under the enrollment CA"
        moment = _utc(now)
        if not certificate.not_valid_before_utc <= moment <= certificate.not_valid_after_utc:
            return "the certificate is expired or not yet valid"
        try:
            constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            constraints = None
        if constraints is None or constraints.ca:
            return "the certificate is not an end-entity certificate"
        try:
            expected = _identity_public_key(identity_key_b64)
        except CertificateError as exc:
            return str(exc)
        subject_key = certificate.public_key()
        if not isinstance(subject_key, Ed25519PublicKey) or _raw(subject_key) != _raw(expected):
            return "the certificate is for a different identity key"
        return None


# Once stored, the CA never changes (the first replica to store one wins, and nothing replaces it):
# each engine's database is read until it has one, then never again (a registration presenting a
# certificate would otherwise pay a query and a PEM parse).
_loaded: weakref.WeakKeyDictionary[AsyncEngine, EnrollmentCA] = weakref.WeakKeyDictionary()


async def load_ca(engine: AsyncEngine) -> EnrollmentCA | None:
    """The stored CA, or None before the first enrollment."""
    ca = _loaded.get(engine)
    if ca is not None:
        return ca
    async with engine.connect() as conn:
        stored = await stored_settings.get(conn, STORED_NAME)
    if stored is None:
        return None
    ca = _loaded[engine] = EnrollmentCA.from_stored(stored)
    return ca


async def load_or_create_ca(engine: AsyncEngine) -> EnrollmentCA:
    """The stored CA, created on first use; replicas racing to create it all end up with the winner's."""
    existing = await load_ca(engine)
    if existing is not None:
        return existing
    candidate = EnrollmentCA.generate()
    async with engine.begin() as conn:
        created = await stored_settings.add(conn, STORED_NAME, candidate.to_stored())
    if created:
        log.info("created the enrollment CA")
        return candidate
    stored = await load_ca(engine)
    assert stored is not None
    return stored
