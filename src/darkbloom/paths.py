"""Where Darkbloom keeps its files ($DARKBLOOM_HOME; docs/cli.md "Files")."""

from __future__ import annotations

import os
from pathlib import Path


def darkbloom_home(*, create: bool = True) -> Path:
    """`$DARKBLOOM_HOME`, default ~/.config/darkbloom; created unless `create` is False (a client
    that only reads files there leaves the disk as it found it)."""
    configured = os.environ.get("DARKBLOOM_HOME")
    home = Path(configured).expanduser() if configured else Path.home() / ".config" / "darkbloom"
    if create:
        home.mkdir(parents=True, exist_ok=True)
    return home


def auth_token_path(home: Path) -> Path:
    return home / "auth_token"


def identity_path(home: Path) -> Path:
    return home / "identity.key"


def provider_config_path(home: Path) -> Path:
    return home / "provider.toml"


def local_token_path(home: Path) -> Path:
    return home / "local_token"


def local_discovery_path(home: Path) -> Path:
    return home / "local.json"


def certificate_path(home: Path) -> Path:
    """The hardware-trust certificate the coordinator issued after an admin enrolled this machine."""
    return home / "certificate.pem"


def node_state_path(home: Path) -> Path:
    return home / "node_state.json"


def pid_path(home: Path) -> Path:
    return home / "node.pid"
