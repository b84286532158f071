"""The test backend the scheduling end-to-end tests give their nodes: `FirstTokenDelayBackend`, and
`tests.support.node_main`, the entry point that passes it to a real `darkbloom serve` process."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend
from darkbloom.provider.config import load_config
from tests.support.backends import FirstTokenDelayBackend, MockBackend
from tests.support.node_main import node_backend, parse, seconds
from tests.support.processes import darkbloom_cmd, node_cmd

OPENAI = {"backend": "openai", "upstream_url": "http://127.0.0.1:9", "models": ["m"]}


def three_words() -> MockBackend:
    """The inner backend: streams "a", "b", "c"."""
    return MockBackend(lambda call: [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in "abc"])


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
    inner = three_words()
    backend = FirstTokenDelayBackend(inner, 0.01)
    await backend.start()
    chunks = [c async for c in backend.stream_chat("m", {})]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["a", "b", "c"]
    assert inner.starts == 1 and len(inner.calls) == 1 and inner.calls[0].ended.is_set()


async def test_a_cancel_interrupts_the_delay() -> None:
    inner = three_words()
    backend = FirstTokenDelayBackend(inner, 3600)

    async def consume() -> list[dict[str, Any]]:
        return [c async for c in backend.stream_chat("m", {})]

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)  # one loop turn: the consumer runs until it waits (all the way, were there no delay)
    assert not task.done() and not inner.calls  # still waiting, nothing generated
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert not inner.calls


async def test_closing_early_closes_the_inner_stream() -> None:
    inner = three_words()
    stream = FirstTokenDelayBackend(inner, 0.01).stream_chat("m", {})
    first = await stream.__anext__()
    assert first["choices"][0]["delta"]["content"] == "a"
    await stream.aclose()  # what the node does on cancel or error
    assert inner.calls[0].ended.is_set()
