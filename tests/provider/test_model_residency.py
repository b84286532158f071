"""Load on demand, unload when idle: the llama.cpp backend with two model ids on the bundled GGUF
(two links to one file), under a memory budget that fits one of them or both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.config import ConfigError
from darkbloom.provider.memory_fit import GIB, MemoryBudget, ModelDoesNotFit

# At n_ctx 1024 and 2 sequences a chat engine of the bundled model needs 179 MB (test_memory_fit): one
# fits in 0.3 GB, two do not; its embeddings engine (329 MB) does not fit even alone.
ONE_FITS = MemoryBudget(int(0.3 * GIB), "--max-memory-gb")
BOTH_FIT = MemoryBudget(2 * GIB, "--max-memory-gb")
LONG_STORY = [{"role": "user", "content": "Write a very long story about a dragon and a lighthouse."}]


@pytest.fixture
def models(gguf: Path, tmp_path: Path) -> dict[str, Path]:
    links = {}
    for model_id in ("a", "b"):
        links[model_id] = tmp_path / f"{model_id}.gguf"
        links[model_id].symlink_to(gguf)
    return links


class Watched:
    """The backend and what `loaded_models()` said after each load or unload."""

    def __init__(self, backend: LlamaCppBackend) -> None:
        self.backend = backend
        self.changes: list[list[str]] = []
        backend.watch_loaded(lambda: self.changes.append(backend.loaded_models()))

    def resident(self, model_id: str, kind: str = "chat") -> Any:
        return self.backend._residency._residents[(model_id, kind)]

    async def until(self, loaded: list[str] | None = None, changes: list[list[str]] | None = None) -> None:
        """Wait (60 s at most) until `loaded_models()` is `loaded`, or the changes seen are `changes`."""
        async with asyncio.timeout(60):
            while (loaded is not None and self.backend.loaded_models() != loaded) or \
                    (changes is not None and self.changes != changes):
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def started(models: dict[str, Path], memory: MemoryBudget, keep_alive: float) -> AsyncIterator[Watched]:
    backend = LlamaCppBackend(models, max_concurrency=2, n_ctx=1024, n_threads=1, memory=memory,
                              keep_alive=keep_alive)
    watched = Watched(backend)
    await backend.start()
    try:
        yield watched
    finally:
        await backend.close()


async def ask(backend: LlamaCppBackend, model_id: str, max_tokens: int = 3) -> str:
    chunks = [chunk async for chunk in backend.stream_chat(
        model_id, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": max_tokens})]
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and all(c["model"] == model_id for c in chunks)
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])


async def test_start_loads_models_in_config_order_while_they_fit(models: dict[str, Path]) -> None:
    async with started(models, ONE_FITS, 300) as one:
        assert one.backend.loaded_models() == ["a"]
    async with started(models, BOTH_FIT, 300) as both:
        assert both.backend.loaded_models() == ["a", "b"]
        assert both.changes == [["a"], ["a", "b"]]


async def test_first_request_loads_its_model_unloading_the_least_recently_used(models: dict[str, Path]) -> None:
    # keep-alive negative: never unloaded for idleness, still unloaded when another model needs the room
    async with started({**models, "c": models["a"]}, MemoryBudget(int(0.5 * GIB), "--max-memory-gb"), -1) as w:
        assert w.backend.loaded_models() == ["a", "b"]  # two of the three fit
        await ask(w.backend, "a")  # a is now more recently used than b
        await ask(w.backend, "c")
        assert w.backend.loaded_models() == ["a", "c"]
        assert w.changes[2:] == [["a"], ["a", "c"]]  # b went first (least recently used), then c loaded
        await ask(w.backend, "b")
        assert w.backend.loaded_models() == ["b", "c"]  # a was less recently used than c


async def test_a_load_waits_while_the_model_holding_the_memory_is_busy(models: dict[str, Path]) -> None:
    async with started(models, ONE_FITS, -1) as w:
        busy = aiter(w.backend.stream_chat("a", {"messages": LONG_STORY, "max_tokens": 300}))
        for _ in range(3):  # generating
            await anext(busy)
        waiting = asyncio.create_task(ask(w.backend, "b"))
        await asyncio.sleep(1.0)  # room for a wrong answer: b loading beside a, or a unloaded under it
        assert not waiting.done() and w.backend.loaded_models() == ["a"]
        assert w.resident("b").leases == 1 and w.resident("b").loading is None
        await busy.aclose()  # a's request ends: a is idle, so b's load unloads it
        await asyncio.wait_for(waiting, 60)
        assert w.backend.loaded_models() == ["b"] and w.changes[-2:] == [[], ["b"]]


async def test_idle_models_unload_after_keep_alive_and_load_again_on_demand(models: dict[str, Path]) -> None:
    async with started(models, BOTH_FIT, 3) as w:  # seconds: b loads before a's keep-alive ends, even on a busy machine
        await w.until([])
        assert w.changes == [["a"], ["a", "b"], ["b"], []]  # each unloads keep-alive seconds after its load
        assert all(w.resident(m).engine is None for m in models)  # the engines are closed and gone
        await ask(w.backend, "b")
        assert w.changes[-1:] == [["b"]] or w.changes[-2:] == [["b"], []]
        await w.until([])


async def test_keep_alive_zero_unloads_when_the_last_request_ends(models: dict[str, Path]) -> None:
    async with started(models, BOTH_FIT, 0) as w:
        assert w.backend.loaded_models() == []  # nothing preloaded: it would unload at once
        await ask(w.backend, "a")
        assert w.backend.loaded_models() == [] and w.changes == [["a"], []]


async def test_a_first_request_is_checked_against_the_vocabulary_it_loads(models: dict[str, Path]) -> None:
    async with started(models, BOTH_FIT, 0) as w:  # nothing loaded yet: the vocabulary is not known
        with pytest.raises(BackendError) as refused:
            async for _ in w.backend.stream_chat("a", {"messages": [{"role": "user", "content": "Hi."}],
                                                       "max_tokens": 2, "logit_bias": {"49152": 5}}):
                pass
        assert (refused.value.status_code, refused.value.param) == (400, "logit_bias")
        with pytest.raises(BackendError) as refused:  # known now: refused before any instance is taken
            async for _ in w.backend.stream_chat("a", {"messages": [{"role": "user", "content": "Hi."}],
                                                       "logit_bias": {"49152": 5}}):
                pass
        assert refused.value.param == "logit_bias" and w.changes == [["a"], []]


async def test_concurrent_first_requests_share_one_load(models: dict[str, Path],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="darkbloom.provider.backends.residency")
    async with started(models, BOTH_FIT, 0) as w:
        answers = await asyncio.gather(ask(w.backend, "a"), ask(w.backend, "a"))
        assert all(answers)
        loads = [r for r in caplog.records if r.getMessage().startswith("model a loaded")]
        assert len(loads) == 1 and w.changes == [["a"], []]
        assert w.resident("a").leases == 0


async def test_cancelling_a_request_that_waits_for_a_load(models: dict[str, Path]) -> None:
    async with started(models, BOTH_FIT, 0) as w:
        waiting = asyncio.create_task(ask(w.backend, "a"))
        async with asyncio.timeout(60):
            while w.resident("a").loading is None:  # the load has started
                await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert w.resident("a").leases == 0
        # the load goes on without it; nobody holds the engine, so keep-alive 0 unloads it at once
        await w.until(changes=[["a"], []])
        assert await ask(w.backend, "a")


async def test_cancelling_a_request_that_waits_for_memory(models: dict[str, Path]) -> None:
    async with started(models, ONE_FITS, -1) as w:
        busy = aiter(w.backend.stream_chat("a", {"messages": LONG_STORY, "max_tokens": 300}))
        await anext(busy)
        waiting = asyncio.create_task(ask(w.backend, "b"))
        async with asyncio.timeout(60):
            while w.resident("b").leases == 0:
                await asyncio.sleep(0)
        await asyncio.sleep(0.2)  # it looks for memory, finds none free, and waits
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await busy.aclose()
        assert w.resident("b").leases == 0 and w.resident("b").loading is None
        assert w.backend.loaded_models() == ["a"] and w.changes == [["a"]]  # b never loaded, a stayed


async def test_an_engine_that_cannot_fit_even_alone_fails_at_once(models: dict[str, Path]) -> None:
    async with started(models, ONE_FITS, -1) as w:
        with pytest.raises(BackendError) as refused:
            async for _ in w.backend.stream_embeddings("a", {"input": "hello"}):
                pass
        assert refused.value.status_code == 503
        assert refused.value.message.startswith("model a needs ") and refused.value.message.endswith(
            " context) for embeddings; this machine has 307 MB (--max-memory-gb)")
        assert w.backend.loaded_models() == ["a"] and w.resident("a", "embedding").leases == 0
        assert await ask(w.backend, "a")


async def test_embeddings_engine_loads_beside_the_chat_engine_and_counts(models: dict[str, Path]) -> None:
    # 0.5 GB: a's chat and embeddings engines share one file and fit together (414 MB); b's chat engine does
    # not fit too
    async with started(models, MemoryBudget(int(0.5 * GIB), "--max-memory-gb"), -1) as w:
        assert w.backend.loaded_models() == ["a", "b"]
        await ask(w.backend, "a")  # b is the least recently used
        chunks = [c async for c in w.backend.stream_embeddings("a", {"input": "hello"})]
        assert len(chunks[0]["data"][0]["embedding"]) == 576
        assert w.resident("a", "embedding").engine is not None and w.resident("a").engine is not None
        assert w.backend.loaded_models() == ["a"]  # b made room


def test_files_that_are_not_gguf_or_do_not_fit_are_refused_before_loading(models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        LlamaCppBackend({"a": models["a"], "text": text})
    with pytest.raises(ModelDoesNotFit, match=r"^model a needs .* this machine has 102 MB \(--max-memory-gb\)$"):
        LlamaCppBackend(models, n_ctx=1024, memory=MemoryBudget(int(0.1 * GIB), "--max-memory-gb"))
