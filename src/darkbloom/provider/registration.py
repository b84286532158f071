"""What a node tells the coordinator about itself at registration, and the files behind it:
the device token (owner), the enrollment certificate (hardware trust), version and hardware, and
what each model serves beyond plain chat (its backend's `capabilities`)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

from darkbloom import paths
from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.provider.backends import Backend, backend_capabilities
from darkbloom.provider.config import ProviderConfig

log = logging.getLogger(__name__)


def register_frame(config: ProviderConfig, home: Path, identity: crypto.NodeIdentity,
                   models: list[protocol.ModelInfo], runtime_hash: str,
                   backend: Backend | None = None) -> protocol.Register:
    if backend is not None:
        models = with_capabilities(models, backend)
    return protocol.Register(
        auth_token=read_auth_token(home), models=models, backend=config.backend, version=version(),
        runtime_hash=runtime_hash, public_key=identity.public_key_b64, identity_key=identity.identity_key_b64,
        attestation=identity.attestation(runtime_hash), certificate=read_certificate(home),
        encrypted_response_chunks=True, private_only=config.private_only,
        max_concurrency=config.max_concurrency, hardware=hardware(), name=config.name,
        max_request_frame_bytes=protocol.MAX_REQUEST_FRAME_BYTES)


def with_capabilities(models: list[protocol.ModelInfo], backend: Backend) -> list[protocol.ModelInfo]:
    """Each model with the capabilities its backend serves it with (images also for a vision model)."""
    out = []
    for info in models:
        names = set(backend_capabilities(backend, info.id)) | ({"images"} if info.is_vision else set())
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


def save_certificate(home: Path, certificate: str) -> None:
    """Keep the enrollment certificate; it is presented as `register.certificate` from now on."""
    path = paths.certificate_path(home)
    try:
        crypto.write_private_file(path, certificate)
    except OSError as exc:
        log.warning("cannot save the enrollment certificate to %s: %s", path, exc)
        return
    log.info("enrollment certificate saved to %s", path)


def version() -> str:
    try:
        return importlib.metadata.version("darkbloom")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def hardware() -> protocol.Hardware:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory = 0.0
    return protocol.Hardware(cpu_count=os.cpu_count() or 0, memory_gb=round(memory, 1))
