"""Device login end to end, a node killed mid-stream, and a client that walks away."""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.accounts import create_account, online_sessions, start_node, wait_model_listed, wait_online
from tests.support.processes import Coordinator, _env, darkbloom_cmd, wait_until

pytestmark = pytest.mark.e2e

LONG = {"model": "smollm2-135m", "stream": True, "max_tokens": 1500,
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}


def test_device_login_links_the_node_to_the_account(coordinator: Coordinator, tmp_path: Path) -> None:
    owner = create_account(coordinator)
    home = tmp_path / "node"
    login = subprocess.Popen(darkbloom_cmd("login", "--coordinator", coordinator.base_url, "--no-browser"),
                             env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert login.stdout is not None
    user_code = None
    for line in login.stdout:
        match = re.search(r"\b([A-Z2-9]{4}-[A-Z2-9]{4})\b", line)
        if match:
            user_code = match.group(1)
            break
    assert user_code, "darkbloom login printed no user code"
    approved = httpx.post(coordinator.api_url + "/device/approve", json={"user_code": user_code},
                          headers={"Authorization": f"Bearer {owner.session}"})
    assert approved.json() == {"status": "approved"}
    output, _ = login.communicate(timeout=60)
    assert login.returncode == 0, output

    token_file = home / "auth_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text().strip().startswith("dkp-")

    node = start_node(coordinator, home)
    try:
        machines = wait_online(coordinator, owner)
        assert machines[0]["id"].startswith("mach_")
        assert machines[0]["session_id"].startswith("prov_")
        assert "smollm2-135m" in machines[0]["models"]
        other = create_account(coordinator)
        assert httpx.get(coordinator.api_url + "/me/providers", headers=other.headers()).json()["data"] == []
    finally:
        node.stop()


def test_node_killed_mid_stream_ends_with_error_event_and_is_evicted(coordinator: Coordinator,
                                                                      tmp_path: Path) -> None:
    owner = create_account(coordinator, credit_micro_usd=10_000_000)
    home = tmp_path / "node"
    from tests.support.accounts import login_node
    login_node(coordinator, home, owner)
    node = start_node(coordinator, home)
    try:
        wait_model_listed(coordinator, owner)
        events: list[str] = []
        with httpx.stream("POST", coordinator.api_url + "/chat/completions", json=LONG,
                          headers=owner.headers(), timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        node.kill()
                        break
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
        assert "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["type"] == "provider_error"
        assert last["error"]["code"] == "provider_unavailable"
        wait_until(lambda: not online_sessions(coordinator, owner), timeout=30, what="node evicted")
    finally:
        node.stop()


def test_client_disconnect_cancels_generation(coordinator: Coordinator, tmp_path: Path) -> None:
    owner = create_account(coordinator, credit_micro_usd=10_000_000)
    home = tmp_path / "node"
    from tests.support.accounts import login_node
    login_node(coordinator, home, owner)
    node = start_node(coordinator, home, "--max-concurrency", "1")
    try:
        wait_model_listed(coordinator, owner)
        with httpx.stream("POST", coordinator.api_url + "/chat/completions", json=LONG,
                          headers=owner.headers(), timeout=60) as response:
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break
        # the node's only slot frees once it stops generating: a new request is served, not refused
        wait_until(lambda: request_id in node.log() and "cancel" in node.log().lower(), timeout=30,
                   what="the node to log the cancel")
        quick = {**LONG, "stream": False, "max_tokens": 4}
        reply = httpx.post(coordinator.api_url + "/chat/completions", json=quick, headers=owner.headers(),
                           timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        node.stop()
