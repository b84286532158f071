"""Trust end to end with real processes: `darkbloom coordinator` with short challenge periods and
`darkbloom serve` nodes — self_signed at registration, kept trusted by periodic challenges,
`hardware` after an admin enrolls the machine and the node restarts with its certificate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support.accounts import create_account, login_node, start_node
from tests.support.processes import Coordinator, start_coordinator, wait_until
from tests.coordinator.fleet.conftest import enroll, machines

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("trust-nodes")
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}",
                              "--challenge-interval", "1", "--challenge-deadline", "2",
                              "--challenge-freshness", "4",
                              env={"DARKBLOOM_LOG_LEVEL": "DEBUG"})  # it logs each passed challenge
    try:
        yield coord
    finally:
        coord.stop()


def _node_state(home: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((home / "node_state.json").read_text()))
    except (OSError, ValueError):
        return {}


def _passed_challenges(coord: Coordinator, session_id: str) -> int:
    """How many challenges the session has passed, from the coordinator's log; fails at once on a
    session marked untrusted (a missed deadline or a wrong answer)."""
    log = coord.process.log()
    assert "marked untrusted" not in log
    return log.count(f"provider {session_id} passed an attestation challenge")


def _online(coord: Coordinator, account: Any, not_session: str | None = None) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for m in machines(coord, account):
            if m["online"] and m["session_id"] != not_session:
                return m
        return None
    return wait_until(found, timeout=120, interval=0.2, what="machine online")  # type: ignore[no-any-return]


def test_node_is_self_signed_then_hardware_after_enrollment_and_restart(coordinator: Coordinator,
                                                                      tmp_path: Path) -> None:
    owner = create_account(coordinator)
    home = tmp_path / "node"
    login_node(coordinator, home, owner)
    node = start_node(coordinator, home)
    try:
        listed = _online(coordinator, owner)
        machine_id, first_session = listed["id"], listed["session_id"]
        assert listed["trust_level"] == "self_signed"
        wait_until(lambda: _node_state(home).get("trust_level") == "self_signed", timeout=30,
                   what="node state self_signed")
        assert not (home / "certificate.pem").exists()

        # periodic challenges (every second, 2 s to answer) keep it trusted: it passes two more after
        # the one at registration
        wait_until(lambda: _passed_challenges(coordinator, first_session) >= 3, timeout=30,
                   what="two periodic challenges passed")
        [still] = [m for m in machines(coordinator, owner) if m["id"] == machine_id]
        assert (still["online"], still["session_id"], still["trust_level"]) == (True, first_session, "self_signed")
        assert "marked untrusted" not in coordinator.process.log()

        response = enroll(coordinator, machine_id)
        assert response.status_code == 200, response.text
        certificate = response.json()["certificate"]
        assert response.json() == {"machine_id": machine_id, "trust_level": "hardware", "certificate": certificate}
        cert_file = home / "certificate.pem"
        wait_until(lambda: cert_file.exists() and cert_file.read_text() == certificate, timeout=30,
                   what="certificate saved by the node")
        wait_until(lambda: _node_state(home).get("trust_level") == "hardware", timeout=30, what="node state hardware")
        [live] = [m for m in machines(coordinator, owner) if m["id"] == machine_id]
        assert (live["session_id"], live["trust_level"]) == (first_session, "hardware")

        # restart the node process: it presents the certificate and registers as hardware
        node.stop()
        node = start_node(coordinator, home)
        listed = _online(coordinator, owner, not_session=first_session)
        assert (listed["id"], listed["trust_level"]) == (machine_id, "hardware")
        second_session = listed["session_id"]
        wait_until(lambda: _node_state(home).get("provider_id") == second_session, timeout=30,
                   what="node registered again")
        assert _node_state(home)["trust_level"] == "hardware"

        # the certificate is what carries hardware trust: without it the machine is self_signed again
        node.stop()
        cert_file.unlink()
        node = start_node(coordinator, home)
        listed = _online(coordinator, owner, not_session=second_session)
        assert (listed["id"], listed["trust_level"]) == (machine_id, "self_signed")
        assert "marked untrusted" not in coordinator.process.log()
    finally:
        node.stop()


def test_enroll_needs_the_admin_token(coordinator: Coordinator) -> None:
    response = httpx.post(f"{coordinator.api_url}/admin/machines/mach_x/enroll")
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_api_key"
