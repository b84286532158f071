"""`darkbloom demo`: coordinator on SQLite + a demo account + a linked node on the bundled model,
all in one process. Everything goes through the real HTTP API and the real device flow."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.server import build_server
from darkbloom.wire.crypto import write_private_file
from darkbloom.logs import configure_logging
from darkbloom.paths import auth_token_path

DEMO_EMAIL = "demo@darkbloom.local"
DEMO_CREDIT_MICRO_USD = 10_000_000  # $10


@dataclass
class DemoCredentials:
    account_id: str
    api_key: str
    password: str
    admin_token: str


def run_demo(home: Path, port: int, out: Console) -> None:
    configure_logging()
    for noisy in ("uvicorn", "uvicorn.error", "alembic", "darkbloom", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(_demo(home, port, out))


async def _demo(home: Path, port: int, out: Console) -> None:
    from darkbloom.provider.config import load_config
    from darkbloom.provider.node import ProviderNode

    home.mkdir(parents=True, exist_ok=True)
    admin_token = _load_state(home).get("admin_token") or secrets.token_urlsafe(24)
    settings = CoordinatorSettings(port=port, database_url=f"sqlite+aiosqlite:///{home / 'coordinator.db'}",
                                   admin_token=admin_token, min_trust="none")
    base_url = settings.base_url
    server = build_server(settings, log_level="warning", own_signals=False)  # the demo owns Ctrl-C
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    server_task = asyncio.create_task(server.serve())
    node_task: asyncio.Task[None] | None = None
    try:
        while not server.started:
            if server_task.done():
                raise SystemExit(f"the coordinator could not start on port {port} (is it in use? try --port)")
            await asyncio.sleep(0.05)
        out.print("[dim]coordinator up; linking a node on the bundled model…[/dim]")
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            creds = await _ensure_account(http, home, admin_token)
            node_home = home / "node"
            await _ensure_linked(http, creds, node_home)
            config = load_config(node_home, {"coordinator_url": base_url, "models": [BUNDLED_MODEL_ID]})
            node_task = asyncio.create_task(ProviderNode(config, node_home).run(stop))
            await _wait_for_model(http, creds.api_key, node_task)
        _print_banner(out, base_url, creds)
        await stop.wait()
        out.print("\nstopping…")
    finally:
        stop.set()
        if node_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node_task, timeout=10)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server_task, timeout=10)


def _state_path(home: Path) -> Path:
    return home / "demo.json"


def _load_state(home: Path) -> dict[str, Any]:
    path = _state_path(home)
    return json.loads(path.read_text()) if path.exists() else {}


async def _ensure_account(http: httpx.AsyncClient, home: Path, admin_token: str) -> DemoCredentials:
    """The demo account with credit and an API key, created once and reused on later runs."""
    state = _load_state(home)
    if state.get("api_key"):
        probe = await http.get("/v1/payments/balance", headers=_bearer(state["api_key"]))
        if probe.status_code == 200:
            return DemoCredentials(state["account_id"], state["api_key"], state["password"], admin_token)
    password = secrets.token_urlsafe(16)
    signup = await http.post("/v1/auth/signup", json={"email": DEMO_EMAIL, "password": password})
    if signup.status_code == 409:
        raise SystemExit(f"{home} holds a demo database without its credentials; delete that folder and retry")
    signup.raise_for_status()
    account_id, session = signup.json()["account_id"], signup.json()["token"]
    key = await http.post("/v1/keys", json={"name": "demo"}, headers=_bearer(session))
    key.raise_for_status()
    credit = await http.post("/v1/admin/credit", headers=_bearer(admin_token), json={
        "account_id": account_id, "amount_micro_usd": DEMO_CREDIT_MICRO_USD, "reference": "demo-initial-credit"})
    credit.raise_for_status()
    creds = DemoCredentials(account_id, key.json()["key"], password, admin_token)
    write_private_file(_state_path(home), json.dumps({
        "account_id": account_id, "api_key": creds.api_key, "password": password, "admin_token": admin_token}))
    return creds


async def _ensure_linked(http: httpx.AsyncClient, creds: DemoCredentials, node_home: Path) -> None:
    """Link the demo node through the device flow, approving its code with the demo API key."""
    token_file = auth_token_path(node_home)
    if token_file.exists():
        probe = await http.get("/v1/payments/balance", headers=_bearer(token_file.read_text().strip()))
        if probe.status_code == 200:
            return
    code = (await http.post("/v1/device/code")).json()
    (await http.post("/v1/device/approve", json={"user_code": code["user_code"]},
                     headers=_bearer(creds.api_key))).raise_for_status()
    grant = (await http.post("/v1/device/token", json={"device_code": code["device_code"]})).json()
    if grant.get("status") != "authorized":
        raise SystemExit(f"device login failed: {grant}")
    write_private_file(token_file, grant["token"])


async def _wait_for_model(http: httpx.AsyncClient, api_key: str, node_task: asyncio.Task[None]) -> None:
    for _ in range(600):
        if node_task.done():
            node_task.result()
            raise SystemExit("the demo node stopped before registering")
        listing = await http.get("/v1/models", headers=_bearer(api_key))
        if any(m["id"] == BUNDLED_MODEL_ID for m in listing.json().get("data", [])):
            return
        await asyncio.sleep(0.1)
    raise SystemExit("the demo node did not come online within 60 s")


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _print_banner(out: Console, base_url: str, creds: DemoCredentials) -> None:
    curl = (f"curl -s {base_url}/v1/chat/completions -H 'Authorization: Bearer {creds.api_key}' "
            f"-H 'Content-Type: application/json' "
            f"-d '{{\"model\":\"{BUNDLED_MODEL_ID}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Say hi\"}}]}}'")
    snippet = (f"from openai import OpenAI\n"
               f"client = OpenAI(base_url=\"{base_url}/v1\", api_key=\"{creds.api_key}\")\n"
               f"r = client.chat.completions.create(model=\"{BUNDLED_MODEL_ID}\", "
               f"messages=[{{\"role\": \"user\", \"content\": \"Say hi\"}}])\n"
               f"print(r.choices[0].message.content)")
    out.print("\n[bold]Darkbloom demo is running[/bold]\n")
    out.print(f"base URL     {base_url}/v1")
    out.print(f"API key      {creds.api_key}")
    out.print(f"console      {base_url}/console/  (log in as {DEMO_EMAIL} / {creds.password})", soft_wrap=True)
    out.print(f"model        {BUNDLED_MODEL_ID} on a node linked to the demo account\n")
    out.print("[bold]curl[/bold]")
    out.print(curl, soft_wrap=True, highlight=False, markup=False)
    out.print("\n[bold]Python (openai SDK)[/bold]")
    out.print(snippet, soft_wrap=True, highlight=False, markup=False)
    out.print("\nCtrl-C stops everything.")
