"""What a node tells the coordinator about itself at registration, and the files behind it:
the device token (owner), the enrollment certificate (hardware trust), version and hardware, and
what each model serves beyond plain chat (its backend's `capabilities`)."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import logging
import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from darkbloom import paths
from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.provider.backends import Backend
from darkbloom.provider.backends.base import device_of
from darkbloom.provider.config import ProviderConfig
from darkbloom.provider.memory_fit import memory_budget

log = logging.getLogger(__name__)


def register_frame(config: ProviderConfig, home: Path, identity: crypto.NodeIdentity,
                   models: list[protocol.ModelInfo], runtime_hash: str,
                   backend: Backend | None = None, loaded_models: list[str] | None = None) -> protocol.Register:
    """`loaded_models`: the ids in memory now (None: all of them, as a backend without loading says)."""
    if backend is not None:
        models = with_capabilities(models, backend)
    return protocol.Register(
        auth_token=read_auth_token(home), models=models, backend=config.backend, version=version(),
        runtime_hash=runtime_hash, public_key=identity.public_key_b64, identity_key=identity.identity_key_b64,
        attestation=identity.attestation(runtime_hash), certificate=read_certificate(home),
        encrypted_response_chunks=True, authenticated_chunks=True, private_only=config.private_only,
        max_concurrency=config.max_concurrency, name=config.name,
        hardware=hardware(config.max_memory_gb, device=device_of(backend), backend=config.backend),
        max_request_frame_bytes=protocol.MAX_REQUEST_FRAME_BYTES, loaded_models=loaded_models)


def with_capabilities(models: list[protocol.ModelInfo], backend: Backend) -> list[protocol.ModelInfo]:
    """Each model with the capabilities its backend serves it with (images also for a vision model;
    completion batches wherever completions are, as the node runs a batch's prompts itself)."""
    out = []
    for info in models:
        names = set(backend.capabilities(info.id)) | ({"images"} if info.is_vision else set())
        if "completions" in names:
            names.add("completion_batches")
        out.append(info.model_copy(update={"capabilities": sorted(names & protocol.CAPABILITIES)}))
    return out


def read_certificate(home: Path) -> str | None:
    """The enrollment certificate the coordinator handed us (hardware trust), if any."""
    try:
        certificate = paths.certificate_path(home).read_text()
    except OSError:
        return None
    return certificate if certificate.strip() else None


def read_auth_token(home: Path) -> str | None:
    """Re-read at every connection, so a `darkbloom login` while the node runs takes effect."""
    try:
        token = paths.auth_token_path(home).read_text().strip()
    except OSError:
        return None
    return token or None


PEM_BEGIN = "-----BEGIN CERTIFICATE-----"
PEM_END = "-----END CERTIFICATE-----"


def certificate_problem(certificate_pem: str, identity_key_b64: str,
                        now: dt.datetime | None = None) -> str | None:
    """Why ``certificate_pem`` is not an enrollment certificate for this node, or None when it may be.

    It must be exactly one PEM X.509 certificate and nothing else, an end-entity certificate
    (BasicConstraints ca=False when present), within its validity period, and for this node's
    Ed25519 identity key. The node does not hold the enrollment CA's certificate, so it cannot
    check who signed it: that is the coordinator's check at every registration."""
    text = certificate_pem.strip()
    if not (text.startswith(PEM_BEGIN) and text.endswith(PEM_END)) or text.count("-----BEGIN ") != 1:
        return "it is not exactly one PEM certificate"
    try:
        certificates = x509.load_pem_x509_certificates(text.encode())
    except (ValueError, UnicodeEncodeError, TypeError):
        return "it is not a PEM X.509 certificate"
    if len(certificates) != 1:
        return "it is not exactly one PEM certificate"
    certificate = certificates[0]
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    except ValueError:
        return "its extensions do not parse"
    if constraints is not None and constraints.ca:
        return "it is a CA certificate, not an end-entity certificate"
    moment = now or dt.datetime.now(dt.timezone.utc)
    if not certificate.not_valid_before_utc <= moment <= certificate.not_valid_after_utc:
        return "it is expired or not yet valid"
    try:
        subject_key = certificate.public_key()
    except (ValueError, UnsupportedAlgorithm):
        return "its public key does not parse"
    try:
        expected = crypto.b64d(identity_key_b64)
    except (ValueError, UnicodeEncodeError):
        return "this node's identity key is not valid base64"
    if not isinstance(subject_key, Ed25519PublicKey) or subject_key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw) != expected:
        return "it is for a different identity key"
    return None


def save_certificate(home: Path, certificate: str, identity_key_b64: str) -> bool:
    """Keep the enrollment certificate, once ``certificate_problem`` finds none; it is presented as
    `register.certificate` from now on. False when it was refused or could not be written."""
    problem = certificate_problem(certificate, identity_key_b64)
    if problem is not None:
        log.warning("not saving the enrollment certificate from the coordinator: %s", problem)
        return False
    path = paths.certificate_path(home)
    try:
        crypto.write_private_file(path, certificate)
    except OSError as exc:
        log.warning("cannot save the enrollment certificate to %s: %s", path, exc)
        return False
    log.info("enrollment certificate saved to %s", path)
    return True


def version() -> str:
    try:
        return importlib.metadata.version("darkbloom")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def hardware(max_memory_gb: float | None = None, device: str | None = None,
             backend: str | None = None) -> protocol.Hardware:
    """`memory_gb` is the budget models may use: `--max-memory-gb`, else the machine's (`memory_fit`);
    `device` where the backend runs its models (`gpu_offload`; None: unknown), `backend` which one it is."""
    return protocol.Hardware(cpu_count=os.cpu_count() or 0, memory_gb=memory_budget(max_memory_gb).gb,
                             device=device, backend=backend)
