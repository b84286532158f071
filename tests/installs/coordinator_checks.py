"""What a coordinator installed on its own must do: start, answer /health, sign a user up, make a
key, and relay a request to a node (one of this tree, linked to the user's account, in front of the
fixed upstream: an exclusive self-routed request, free)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.installs.support import blame
from tests.support.accounts import create_account, device_token, start_node, wait_online
from tests.support.processes import Process, start_coordinator, start_fixed_upstream

FIXED_ANSWER = "The quick brown fox jumps over the lazy dog."  # bench/fixed_upstream.py's answer


def serve_a_request_through(venv: Path, root: Path) -> None:
    processes: list[Process] = []
    coordinator = None
    try:
        try:
            coordinator = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'c.db'}",
                                             program=[str(venv / "bin" / "darkbloom")])
        except RuntimeError as exc:
            raise AssertionError(f"the installed coordinator did not serve ({blame(venv, str(exc))}):\n{exc}") \
                from None
        assert httpx.get(coordinator.base_url + "/health", timeout=10).json() == {"status": "ok"}
        account = create_account(coordinator)
        upstream, upstream_url = start_fixed_upstream(root / "upstream")
        processes.append(upstream)
        node_home = root / "node"
        node_home.mkdir()
        (node_home / "auth_token").write_text(device_token(coordinator, account) + "\n")
        (node_home / "auth_token").chmod(0o600)
        processes.append(start_node(coordinator, node_home, "--backend", "openai", "--upstream-url", upstream_url,
                                    "--model", "smollm2-135m"))
        wait_online(coordinator, account)
        answer = httpx.post(coordinator.api_url + "/chat/completions", timeout=60,
                            headers={**account.headers(), "X-Darkbloom-Route": "self"},
                            json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]})
        log = coordinator.process.log()
        assert answer.status_code == 200, f"{answer.text}\n({blame(venv, log)})\n{log[-5000:]}"
        assert answer.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
        assert answer.headers["x-darkbloom-routed"] == "owned"
    finally:
        for process in processes:
            process.stop()
        if coordinator is not None:
            coordinator.stop()
