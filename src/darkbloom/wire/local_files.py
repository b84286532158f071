"""Direct mode's two files in `$DARKBLOOM_HOME` (docs/cli.md "Files"): the bearer token `local_token` and the
discovery file `local.json`. The node writes them; the client reads them. Both are 0600."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from darkbloom.wire import crypto
from darkbloom.paths import local_discovery_path, local_token_path

LOCAL_TOKEN_PREFIX = "dk-local-"


class LocalTokenError(Exception):
    """The direct-mode token cannot be read or created; the node refuses to serve without one."""


def load_or_create_local_token(home: Path) -> str:
    """The token in `local_token`, created on first use (0600) and reused afterwards."""
    path = local_token_path(home)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    except OSError as exc:
        raise LocalTokenError(f"cannot read the direct-mode token {path}: {exc.strerror or exc}; "
                              "fix its permissions or delete it to get a new one") from None
    if token.startswith(LOCAL_TOKEN_PREFIX) and len(token) > len(LOCAL_TOKEN_PREFIX) + 16:
        _keep_private(path)
        return token
    token = crypto.new_token(LOCAL_TOKEN_PREFIX)
    try:
        crypto.write_private_file(path, token + "\n")
    except OSError as exc:
        raise LocalTokenError(f"cannot create the direct-mode token {path}: {exc.strerror or exc}; "
                              "direct mode never serves without its token") from None
    return token


def _keep_private(path: Path) -> None:
    try:
        if stat.S_IMODE(path.stat().st_mode) != 0o600:
            os.chmod(path, 0o600)
    except OSError as exc:
        raise LocalTokenError(f"cannot make {path} private (mode 0600): {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Discovery:
    """`local.json`: where this machine's direct-mode endpoint listens and the token it wants."""

    base_url: str  # http://host:port/v1, ready for OpenAI(base_url=...)
    api_key: str
    host: str  # the address clients on this machine connect to (127.0.0.1 when bound to 0.0.0.0)
    port: int
    pid: int


def write_discovery(home: Path, discovery: Discovery) -> None:
    crypto.write_private_file(local_discovery_path(home), json.dumps(asdict(discovery), indent=1) + "\n")


def remove_discovery(home: Path, pid: int) -> None:
    """Remove `local.json` if it is still this process's (a newer node may have replaced it)."""
    found = read_discovery(home)
    if found is None or found.pid == pid:
        local_discovery_path(home).unlink(missing_ok=True)


def read_discovery(home: Path) -> Discovery | None:
    """`local.json` if present and well formed, else None."""
    try:
        data = json.loads(local_discovery_path(home).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    base_url, api_key, host, port, pid = (data.get(k) for k in ("base_url", "api_key", "host", "port", "pid"))
    if not (isinstance(base_url, str) and base_url and isinstance(api_key, str) and api_key
            and isinstance(host, str) and _is_int(port) and _is_int(pid)):
        return None
    return Discovery(base_url=base_url, api_key=api_key, host=host, port=port, pid=pid)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
