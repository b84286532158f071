"""Background start / stop / status with a real `python -m darkbloom serve` process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from darkbloom import paths
from darkbloom.wire import protocol
from darkbloom.provider.config import load_config
from darkbloom.provider.runner import StartError, _serve_args, node_status, start_background, stop_background
from tests.provider.fake_coordinator import FakeCoordinator


def test_status_of_a_node_that_never_ran(home: Path) -> None:
    status = node_status(home)
    assert set(status) == {"coordinator", "account", "connection", "provider_id", "models", "trust_level",
                           "private_only", "backend", "device", "direct_mode_url"}
    assert status["connection"] == "not running"
    assert (status["backend"], status["device"]) == ("llama-cpp", None)  # where it runs: known once it runs
    assert status["coordinator"] == "http://127.0.0.1:8080"
    assert status["models"] == "smollm2-135m"
    assert "darkbloom login" in str(status["account"])
    paths.auth_token_path(home).write_text("dkp-x")
    assert "linked" in str(node_status(home)["account"])


def test_background_args_carry_direct_mode(home: Path) -> None:
    config = load_config(home, {"local_port": 8123, "local_bind": "0.0.0.0"})
    local_only = _serve_args(config, local_only=True)
    assert "--local-only" in local_only and "--local-endpoint" not in local_only
    assert local_only[local_only.index("--port") + 1] == "8123"
    assert local_only[local_only.index("--bind") + 1] == "0.0.0.0"
    config.local_endpoint = True
    beside = _serve_args(config)
    assert "--local-endpoint" in beside and "--local-only" not in beside
    config.local_endpoint = False
    assert not {"--local-endpoint", "--local-only"} & set(_serve_args(config))


def test_background_args_carry_the_gpu_layers(home: Path) -> None:
    assert "--gpu-layers" not in _serve_args(load_config(home, {}))  # the build decides in the node too
    for asked, passed in (("all", "-1"), ("0", "0"), ("12", "12")):
        args = _serve_args(load_config(home, {"gpu_layers": asked}))
        assert args[args.index("--gpu-layers") + 1] == passed


def test_stop_without_a_node(home: Path) -> None:
    assert stop_background(home) is False
    paths.pid_path(home).write_text("999999999\n")  # stale pid file
    assert stop_background(home) is False
    assert not paths.pid_path(home).exists()


async def test_background_node_starts_connects_and_stops(home: Path) -> None:
    async with FakeCoordinator() as fake:
        config = load_config(home, {"coordinator_url": fake.url, "max_concurrency": 1, "private_only": True})
        pid = await asyncio.to_thread(start_background, config, home, False)
        try:
            assert paths.pid_path(home).read_text().strip() == str(pid)
            conn = await fake.accept(timeout=120)
            register = await conn.recv()
            assert isinstance(register, protocol.Register)
            assert (register.max_concurrency, register.private_only) == (1, True)
            await conn.send(protocol.Registered(provider_id="prov_bg", account_id="acct_bg", trust_level="none"))
            while node_status(home)["provider_id"] != "prov_bg":  # bounded by the test timeout
                await asyncio.sleep(0.05)
            status = node_status(home)
            assert (status["connection"], status["account"], status["coordinator"], status["private_only"]) == \
                ("connected", "acct_bg", fake.url, True)
            assert (status["backend"], status["device"]) == ("llama-cpp", "cpu")  # this machine's CPU build
            with pytest.raises(StartError, match=f"already running \\(pid {pid}\\)"):
                start_background(config, home, local_only=False)
        finally:
            stopped = await asyncio.to_thread(stop_background, home)
        assert stopped is True
        assert not paths.pid_path(home).exists()
        assert node_status(home)["connection"] == "not running"
        assert "node stopped" in (home / "node.log").read_text()  # a clean exit on SIGTERM
        assert stop_background(home) is False
