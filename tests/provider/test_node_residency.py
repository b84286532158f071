"""A node serving more models than fit at once: registration and heartbeats say which are loaded,
a request for an unloaded one loads it, direct mode lists them all; and a model that cannot fit at
all stops `serve` and `start` with one sentence (real processes)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx

from darkbloom import paths
from darkbloom.provider.config import load_config
from darkbloom.provider.node import ProviderNode
from darkbloom.wire import crypto, protocol
from tests.provider.fake_coordinator import FakeCoordinator
from tests.support.processes import _env, darkbloom_cmd

SAY_HI = [{"role": "user", "content": "Say hi."}]


def two_models(gguf: Path, tmp_path: Path) -> list[str]:
    """Two model ids on the bundled file; at n_ctx 1024 one fits in 0.3 GB, two do not (test_model_residency)."""
    specs = []
    for model_id in ("a", "b"):
        link = tmp_path / f"{model_id}.gguf"
        link.symlink_to(gguf)
        specs.append(f"{model_id}={link}")
    return specs


def node_for(home: Path, overrides: dict[str, Any]) -> ProviderNode:
    config = load_config(home, overrides)
    config.context_length = 1024
    config.heartbeat_interval_secs = 60  # every heartbeat a test sees is one a load or unload sent
    return ProviderNode(config, home)


async def test_heartbeats_follow_loads_and_unloads(home: Path, gguf: Path, tmp_path: Path) -> None:
    paths.auth_token_path(home).write_text("dkp-test-token\n")
    async with FakeCoordinator() as fake:
        node = node_for(home, {"coordinator_url": fake.url, "models": two_models(gguf, tmp_path),
                               "max_memory_gb": 0.3, "keep_alive": 2})
        stop = asyncio.Event()
        task = asyncio.create_task(node.run(stop))
        try:
            conn = await fake.accept()
            register = await conn.recv()
            assert isinstance(register, protocol.Register)
            assert [m.id for m in register.models] == ["a", "b"]  # advertised: both
            assert register.loaded_models == ["a"]  # loaded: what fits, in config order
            assert register.hardware.memory_gb == 0.3  # the budget in force
            await conn.send(protocol.Registered(provider_id="prov_r", account_id="acct_r", trust_level="self_signed"))

            reply_key = crypto.ReplyKey()
            body = {"model": "b", "messages": SAY_HI, "max_tokens": 3}
            envelope = reply_key.seal_request(json.dumps(body).encode(),
                                              crypto.public_key_from_b64(register.public_key))
            await conn.send(protocol.InferenceRequest(request_id="req_b", encrypted_body=envelope))
            while not isinstance(frame := await conn.recv(), protocol.InferenceComplete):
                assert not isinstance(frame, protocol.InferenceError), frame
            assert frame.request_id == "req_b" and frame.usage.completion_tokens > 0
            # b loaded on demand (a unloaded to make room, or idle for its 2 s keep-alive first) ...
            while (heartbeat := await conn.recv_type(protocol.Heartbeat)).models != []:
                pass
            # ... and unloads after its keep-alive; each heartbeat followed a change, none was periodic
            heartbeats = [f.models for f in conn.frames if isinstance(f, protocol.Heartbeat)]
            assert heartbeats in ([[], ["b"], []], [["b"], []])
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def test_direct_mode_lists_every_model_and_loads_the_one_asked_for(home: Path, gguf: Path,
                                                                         tmp_path: Path) -> None:
    node = node_for(home, {"models": two_models(gguf, tmp_path), "max_memory_gb": 0.3, "keep_alive": -1,
                           "local_port": 0})
    node.local_only = True
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    try:
        async with asyncio.timeout(60):
            while not paths.local_discovery_path(home).exists():
                assert not task.done(), task.exception()
                await asyncio.sleep(0.02)
        found = json.loads(paths.local_discovery_path(home).read_text())
        headers = {"Authorization": f"Bearer {found['api_key']}"}
        assert node.backend.loaded_models() == ["a"]  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=found["base_url"], headers=headers, timeout=60) as http:
            listed = (await http.get("/models")).json()
            assert [m["id"] for m in listed["data"]] == ["a", "b"]
            answer = await http.post("/chat/completions", json={"model": "b", "messages": SAY_HI, "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["model"] == "b"
        assert node.backend.loaded_models() == ["b"]  # type: ignore[attr-defined]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


NEED = re.compile(r"model smollm2-135m needs \d+ MB \(94 MB file \+ \d+ MB context for 1 request\); "
                  r"this machine has 102 MB \(--max-memory-gb\)")


def test_serve_and_start_refuse_a_model_that_cannot_fit(home: Path) -> None:
    args = ("--coordinator", "http://127.0.0.1:9", "--max-memory-gb", "0.1")
    served = subprocess.run(darkbloom_cmd("serve", *args), env=_env(home), capture_output=True, text=True,
                            timeout=120)
    assert served.returncode == 1, served.stdout + served.stderr
    output = (served.stdout + served.stderr).strip().splitlines()
    assert len(output) == 1 and NEED.search(output[0]), output
    started = subprocess.run(darkbloom_cmd("start", *args), env=_env(home), capture_output=True, text=True,
                             timeout=120)
    assert started.returncode == 1 and NEED.search(" ".join(started.stderr.split())), started.stderr
    assert not paths.pid_path(home).exists()
