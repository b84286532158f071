"""The node's state file (`$DARKBLOOM_HOME/node_state.json`), written by the node for `darkbloom status`."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from darkbloom.paths import node_state_path


@dataclass
class NodeState:
    coordinator_url: str = ""
    connected: bool = False
    provider_id: str | None = None
    account_id: str | None = None
    trust_level: str | None = None
    models: list[str] = field(default_factory=list)
    private_only: bool = False
    backend: str = ""  # llama-cpp or openai
    device: str | None = None  # where the backend runs its models (cpu, metal, cuda, …); None: unknown (an upstream)
    local_url: str | None = None  # the direct-mode base URL while it serves
    local_only: bool = False  # `start --local`: direct mode only, no coordinator
    pid: int = field(default_factory=os.getpid)
    updated_at: float = 0.0


def write_state(home: Path, state: NodeState) -> None:
    state.updated_at = time.time()
    path = node_state_path(home)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    os.replace(tmp, path)


def read_state(home: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(node_state_path(home).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
