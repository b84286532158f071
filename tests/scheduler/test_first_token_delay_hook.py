"""The provider test hook the scheduling end-to-end tests use: DARKBLOOM_TEST_FIRST_TOKEN_DELAY."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from darkbloom.provider.backends import create_backend
from darkbloom.provider.backends.base import UsageMeter
from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend
from darkbloom.provider.backends.test_hooks import (
    FIRST_TOKEN_DELAY_ENV,
    FirstTokenDelayBackend,
    parse_first_token_delay,
)
from darkbloom.provider.config import ConfigError, load_config

OPENAI = {"backend": "openai", "upstream_url": "http://127.0.0.1:9", "models": ["m"]}


class FakeBackend:
    def __init__(self) -> None:
        self.started = 0
        self.streams_started = 0
        self.streams_closed = 0

    async def start(self) -> None:
        self.started += 1

    async def close(self) -> None:
        pass

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self.streams_started += 1
        try:
            for word in ("a", "b", "c"):
                yield {"choices": [{"index": 0, "delta": {"content": word}}]}
        finally:
            self.streams_closed += 1


def test_parse() -> None:
    assert parse_first_token_delay(None) == 0.0
    assert parse_first_token_delay(" ") == 0.0
    assert parse_first_token_delay("2.5") == 2.5
    assert parse_first_token_delay("0") == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match=FIRST_TOKEN_DELAY_ENV):
            parse_first_token_delay(bad)


def test_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FIRST_TOKEN_DELAY_ENV, raising=False)
    config = load_config(tmp_path, dict(OPENAI))
    assert config.test_first_token_delay == 0.0
    assert isinstance(create_backend(config), OpenAIUpstreamBackend)


def test_read_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FIRST_TOKEN_DELAY_ENV, "3")
    config = load_config(tmp_path, dict(OPENAI))
    assert config.test_first_token_delay == 3.0
    backend = create_backend(config)
    assert isinstance(backend, FirstTokenDelayBackend) and backend.delay == 3.0
    assert isinstance(backend.inner, OpenAIUpstreamBackend)
    monkeypatch.setenv(FIRST_TOKEN_DELAY_ENV, "later")
    with pytest.raises(ConfigError, match=FIRST_TOKEN_DELAY_ENV):
        load_config(tmp_path, dict(OPENAI))


async def test_chunks_pass_through_after_the_delay() -> None:
    inner = FakeBackend()
    backend = FirstTokenDelayBackend(inner, 0.01)
    await backend.start()
    chunks = [c async for c in backend.stream_chat("m", {})]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["a", "b", "c"]
    assert inner.started == 1 and inner.streams_started == inner.streams_closed == 1


async def test_a_cancel_interrupts_the_delay() -> None:
    inner = FakeBackend()
    backend = FirstTokenDelayBackend(inner, 3600)

    async def consume() -> list[dict[str, Any]]:
        return [c async for c in backend.stream_chat("m", {})]

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    assert not task.done() and inner.streams_started == 0  # still waiting, nothing generated
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert inner.streams_started == 0


async def test_closing_early_closes_the_inner_stream() -> None:
    inner = FakeBackend()
    stream = FirstTokenDelayBackend(inner, 0.01).stream_chat("m", {})
    first = await stream.__anext__()
    assert first["choices"][0]["delta"]["content"] == "a"
    await stream.aclose()  # what the node does on cancel or error
    assert inner.streams_closed == 1
