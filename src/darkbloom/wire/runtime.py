"""The runtime hash: a digest of the installed provider code, reported at registration.

The coordinator's default allow-list is its own installed release's hash (docs/protocol.md "Registration and trust")."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).parent.parent
_RUNTIME_PARTS = ("provider", "wire")  # the node's code and the protocol, crypto and OpenAI edge it shares


@functools.cache
def runtime_hash() -> str:
    digest = hashlib.sha256()
    for part in _RUNTIME_PARTS:
        path = _PACKAGE_ROOT / part
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(_PACKAGE_ROOT)).encode())
            digest.update(b"\0")
            digest.update(file.read_bytes())
            digest.update(b"\0")
    return "sha256:" + digest.hexdigest()
