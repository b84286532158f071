from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import pytest

from darkbloom.provider.bundled_model import bundled_gguf_path
from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from tests.support.processes import listening_port, spawn, wait_http
from tests.support.scripted_upstream import Handler, Scripted, scripted_upstream

if TYPE_CHECKING:  # imported when the fixture runs: llama_cpp only for the tests that use it
    from tests.support.recording_backend import RecordingLlamaCppBackend


@pytest.fixture(scope="session")
def gguf() -> Path:
    return bundled_gguf_path()


@pytest.fixture
async def backend(gguf: Path, request: pytest.FixtureRequest) -> AsyncIterator[RecordingLlamaCppBackend]:
    """The bundled model on a started llama.cpp backend that records its generations; a module says how
    large with `pytestmark = pytest.mark.llama(max_concurrency=…, n_ctx=…)` (default 1 and 1024)."""
    from tests.support.recording_backend import RecordingLlamaCppBackend

    marker = request.node.get_closest_marker("llama")
    size = {"max_concurrency": 1, "n_ctx": 1024, **(marker.kwargs if marker is not None else {})}
    instance = RecordingLlamaCppBackend({BUNDLED_MODEL_ID: gguf}, **size)
    await instance.start()
    try:
        yield instance
    finally:
        await instance.close()


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


@pytest.fixture(scope="session")
def upstream(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's own OpenAI-compatible server on the bundled model: a real third-party upstream."""
    process = spawn([sys.executable, "-c", _SERVER, "--model", str(gguf), "--model_alias", "smollm2-135m",
                     "--host", "127.0.0.1", "--port", "0", "--n_ctx", "1024", "--n_threads", "1"],
                    tmp_path_factory.mktemp("upstream"), "server.log")
    try:
        url = f"http://127.0.0.1:{listening_port(process, timeout=120)}"
        wait_http(url + "/v1/models", process, timeout=120)
        yield url
    finally:
        process.stop(timeout=30)


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    """Starts a scripted upstream (tests/support/scripted_upstream.py) per call, stopped after the test:
    ``url = await scripted(handler)``."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(handler: Handler) -> str:
            return await stack.enter_async_context(scripted_upstream(handler))
        yield start
