"""How this replica proves itself to NATS and checks the server: the keyword arguments of
``nats.connect`` from ``--nats-creds``, ``--nats-nkey`` and ``--nats-tls-*``, and service URLs as
they may be logged (credentials hidden).

nats-py reads a .creds file again at every (re)connection; the nkey's public key and the TLS context
are fixed when the replica starts.
"""

from __future__ import annotations

import re
import ssl
from typing import Any

from darkbloom.coordinator.config import CoordinatorSettings

_USERINFO = re.compile(r"^(?P<head>\s*(?:[A-Za-z][A-Za-z0-9+.-]*://)?)(?P<userinfo>[^/?#]*)@")


def connect_options(settings: CoordinatorSettings) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if settings.nats_creds is not None:
        options["user_credentials"] = str(settings.nats_creds)
    if settings.nats_nkey is not None:
        options["nkeys_seed"] = str(settings.nats_nkey)
    if settings.nats_tls_ca is not None or settings.nats_tls_cert is not None:
        options["tls"] = _tls_context(settings)
    return options


def _tls_context(settings: CoordinatorSettings) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=settings.nats_tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--nats-tls-ca: cannot load {settings.nats_tls_ca}: {exc}") from None
    if settings.nats_tls_cert is not None:
        try:
            context.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--nats-tls-cert/--nats-tls-key: cannot load {settings.nats_tls_cert} "
                             f"with {settings.nats_tls_key}: {exc}") from None
    return context


def redacted(url: str) -> str:
    """``url`` (or a comma-separated list of URLs) with passwords and tokens replaced by ``***``:
    ``nats://alice:s3cret@host`` → ``nats://alice:***@host``, ``nats://tok@host`` → ``nats://***@host``."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    match = _USERINFO.match(url)
    if match is None:
        return url
    user, colon, _secret = match["userinfo"].partition(":")
    hidden = f"{user}:***" if colon else "***"
    return f"{match['head']}{hidden}@{url[match.end():]}"
