"""Where a direct-first client sends requests: a local endpoint (given, or discovered through
`$DARKBLOOM_HOME/local.json`) and the coordinator."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from darkbloom.paths import darkbloom_home
from darkbloom.wire.local_files import read_discovery


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible base URL (with or without the trailing `/v1`) and its bearer token."""

    base_url: str
    api_key: str

    @property
    def root(self) -> str:
        """The base URL without a trailing `/v1`: request paths from `/v1/…` go after it."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root


def discover_local_endpoint(home: Path | None = None) -> Endpoint | None:
    """The endpoint in `local.json`, unless missing, malformed or left behind by a node that is gone."""
    discovery = read_discovery(home if home is not None else darkbloom_home(create=False))
    if discovery is None or not _alive(discovery.pid):
        return None
    return Endpoint(discovery.base_url, discovery.api_key)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
