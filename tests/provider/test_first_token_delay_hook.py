"""The test backend the scheduling end-to-end tests give their nodes: `FirstTokenDelayBackend`, and
`tests.support.node_main`, the entry point that passes it to a real `darkbloom serve` process."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from darkbloom.provider.backends.base import UsageMeter
from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend
from darkbloom.provider.config import load_config
from tests.support.backends import FirstTokenDelayBackend
from tests.support.node_main import node_backend, parse, seconds
from tests.support.processes import darkbloom_cmd, node_cmd

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

    def capabilities(self, model_id: str) -> frozenset[str]:
        return frozenset()

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self.streams_started += 1
        try:
            for word in ("a", "b", "c"):
                yield {"choices": [{"index": 0, "delta": {"content": word}}]}
        finally:
            self.streams_closed += 1


def test_the_delay_option() -> None:
    assert seconds("2.5") == 2.5 and seconds("0") == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="--first-token-delay"):
            seconds(bad)
    options = parse(["--first-token-delay", "3", "serve", "--coordinator", "http://h:1", "--model", "m"])
    assert options.first_token_delay == 3.0 and options.direct_fail is None
    assert options.cli_args == ["serve", "--coordinator", "http://h:1", "--model", "m"]


def test_node_cmd_uses_the_real_cli_unless_a_hook_is_on() -> None:
    assert node_cmd("serve", "--model", "m") == darkbloom_cmd("serve", "--model", "m")
    hooked = node_cmd("serve", "--model", "m", first_token_delay=3)
    assert hooked[1:] == ["-m", "tests.support.node_main", "--first-token-delay", "3", "serve", "--model", "m"]
    assert parse(hooked[3:]).first_token_delay == 3.0


def test_off_without_a_delay(tmp_path: Path) -> None:
    assert isinstance(node_backend(load_config(tmp_path, dict(OPENAI)), 0.0), OpenAIUpstreamBackend)


def test_wraps_the_backend_the_config_names(tmp_path: Path) -> None:
    backend = node_backend(load_config(tmp_path, dict(OPENAI)), 3.0)
    assert isinstance(backend, FirstTokenDelayBackend) and backend.delay == 3.0
    assert isinstance(backend.inner, OpenAIUpstreamBackend)


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
    await asyncio.sleep(0)  # one loop turn: the consumer runs until it waits (all the way, were there no delay)
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
