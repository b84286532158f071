"""A shared stack for end-to-end tests: a real coordinator and a real, linked provider node."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.accounts import Account, create_account, login_node, start_node, wait_model_listed
from tests.support.processes import Coordinator, Process, start_coordinator

pytestmark = pytest.mark.e2e


@dataclass
class Stack:
    coordinator: Coordinator
    owner: Account
    node: Process
    node_home: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}")
    node = None
    try:
        owner = create_account(coord, credit_micro_usd=10_000_000)
        node_home = root / "node"
        login_node(coord, node_home, owner)
        node = start_node(coord, node_home, "--max-concurrency", "2")
        wait_model_listed(coord, owner)
        yield Stack(coord, owner, node, node_home)
    finally:
        if node is not None:
            node.stop()
        coord.stop()
