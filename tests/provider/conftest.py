from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from darkbloom.provider.bundled_model import bundled_gguf_path
from tests.support.scripted_upstream import Handler, Scripted, scripted_upstream


@pytest.fixture(scope="session")
def gguf() -> Path:
    return bundled_gguf_path()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("DARKBLOOM_HOME", str(path))
    return path


# llama_cpp.server with llama.cpp's extra buffer types off, as the node's default has them (see
# `CountingLlama`: AMX kernels crash on some VMs); the server has no option for it.
_SERVER = """
import runpy
import llama_cpp.llama_cpp as raw

library_defaults = raw.llama_model_default_params

def defaults_without_extra_buffer_types():
    params = library_defaults()
    params.use_extra_bufts = False
    return params

raw.llama_model_default_params = defaults_without_extra_buffer_types
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def upstream(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's own OpenAI-compatible server on the bundled model: a real third-party upstream."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("upstream") / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, "--model", str(gguf), "--model_alias", "smollm2-135m",
             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_threads", "1"],
            stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"llama_cpp.server exited: {log_path.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    """Starts a scripted upstream (tests/support/scripted_upstream.py) per call, stopped after the test:
    ``url = await scripted(handler)``."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(handler: Handler) -> str:
            return await stack.enter_async_context(scripted_upstream(handler))
        yield start
